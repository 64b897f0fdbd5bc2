"""Changes to py-libp2p 0.8.1 itself, each pinned by a test in ``tests/overlay/``.

- ``tuning.py``: stream and connection limits and timeouts py-libp2p hard-codes.
- ``safepubsub.py``: gossipsub handlers that survive a peer's malformed or oversized message.
- ``containment.py``: errors in libp2p's background tasks stay inside the task that raised them.
- ``gate.py``: in a closed network, no protocol but the hello runs with a non-member (inbound
  negotiation and ``host.new_stream`` both gated).
- ``busy.py``: bounded inbound handshakes and stream negotiations (a join storm is turned
  away at once, not queued until every joiner gives up); abandoned streams skipped.
- ``dcutr.py``: hole punching (DCUtR) between NAT'd peers: the source port, the addresses
  offered and dialed, who initiates, and a peer's relayed connection draining after the punch.

On a libp2p upgrade: read each module's first lines (what it replaces, and where upstream),
check the upstream code it names still has the defect, and run ``tests/overlay/test_tuning.py``,
``test_safepubsub.py``, ``test_containment.py``, ``test_closed.py``, ``test_busy.py`` and
``test_dcutr_patch.py`` (and ``tests/system/test_holepunch_netns.py``); drop a patch whose
defect is fixed.
"""
