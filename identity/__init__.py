"""p2pnode.identity"""
