"""p2pnode.overlay"""
