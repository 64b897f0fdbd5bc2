"""p2pnode.inference"""
