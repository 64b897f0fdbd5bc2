"""p2pnode.speculation"""
