"""p2pnode.testnet"""
