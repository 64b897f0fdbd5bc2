"""p2pnode.bootstrap"""
