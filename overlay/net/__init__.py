"""Membership and transport: the libp2p host, dialing, discovery, admission and the hello,
liveness, the DHT, addresses and reachability, circuit relays, connection trimming.

Map: ``node.py`` assembles an ``OverlayNode`` from ``config.py``'s knobs and its collaborators,
one job each (``admission``, ``dialing``, ``discovery``, ``liveness`` with ``starvation``,
``trimming``, ``connmgr``); ``host.py`` builds the libp2p host; ``hello.py`` checks network and
version on every connection; ``dht.py`` holds node records; ``addrs.py`` and ``reachability.py``
decide what to advertise; ``relay.py`` runs circuit relay v2. Closed networks: ``members.py``
(who is a member, ``ClosedNetwork``), ``redemption.py`` (invites traded for memberships),
``revocations.py`` (gossiped revocations), ``patches/gate.py`` (nothing but the hello runs with
a non-member). ``patches/`` holds what we change in py-libp2p itself.
"""
