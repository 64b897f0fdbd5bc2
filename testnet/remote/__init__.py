"""Trials on real hosts over SSH: ``inventory.py`` (the hosts, from TOML), ``ssh.py`` (the
system OpenSSH client: commands, sessions, API tunnels), ``hold.py`` (the remote wrapper a
node runs under: it dies with its SSH session), ``probe.py`` (what a host reports before a
run), ``preflight.py`` (reachability, clocks, same code, RTT matrix), ``envs.py``
(a wheel of the checkout installed on hosts), ``controller.py`` (bring-up, workload, results,
teardown), ``faults.py`` (churn on remote nodes).
"""
