"""Networks for trials: ``namespaces.py`` (network namespaces, bridges, NAT routers),
``swarm.py`` (nodes started with the flags a user types), ``wan.py`` (userspace WAN delay).
"""
