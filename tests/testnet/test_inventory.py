"""The trial inventory (testnet/remote/inventory.py): the shipped sample parses, and bad
files fail with an error that names the host and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pnode.testnet.remote.inventory import InventoryError, load_inventory, parse_inventory

SAMPLE = Path(__file__).resolve().parents[2] / "docs" / "testnet-inventory.toml"
ENV = {"python": "/opt/venv/bin/python"}


def _inv(*hosts: dict, **top) -> dict:
    return {"env": ENV, "host": list(hosts), **top}


BOOT = {"name": "boot", "address": "10.0.0.1", "role": "bootstrap"}
SERVE = {"name": "a", "address": "10.0.0.2", "role": "serving"}


def test_sample_inventory_parses_into_ordered_waves():
    inv = load_inventory(SAMPLE)
    assert inv.bootstrap.name == "boot-eu"
    waves = [[h.name for h in w] for w in inv.start_order()]
    assert waves == [["boot-eu"], ["relay-us", "lab-us"], ["gpu-eu", "home-asia"]]
    lab = inv.host("lab-us")
    assert (lab.port, lab.jump, lab.engine) == (
        2222,
        "alice@bastion.lab.example.org:22",
        "emulated",
    )
    assert inv.host("gpu-eu").env.interpreter == "/opt/p2pnode/.venv/bin/python"
    assert inv.host("boot-eu").env.interpreter == "~/p2pnode-trials/venv/bin/python"
    assert inv.redacted()["ssh"]["identity_file"] == "(set)"  # no key paths in results


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_inv(SERVE), "exactly one host has role = 'bootstrap'"),
        (_inv(BOOT), "no host takes the workload"),
        (_inv(BOOT, {**SERVE, "role": "server"}), "host 'a': role: 'server' is not one of"),
        (_inv(BOOT, {**SERVE, "port": 70000}), "host 'a': port: 70000 is not a TCP port"),
        (_inv(BOOT, {**SERVE, "adress": "x"}), "host 'a': unknown keys adress"),
        (_inv(BOOT, {**SERVE, "name": "a b"}), "name: 'a b': use 1-40 letters"),
        (_inv(BOOT, SERVE, {**SERVE, "address": "10.0.0.3"}), "host names must be unique: a"),
        (_inv({**BOOT, "model": "default"}, SERVE), "a bootstrap node serves no model"),
        (_inv(BOOT, {**SERVE, "engine": "gpu"}), "engine: 'gpu' is not one of hf, vllm"),
        ({"host": [BOOT, SERVE]}, "no Python environment"),
        (_inv(BOOT, {**SERVE, "env": {"python": "p", "create": "d"}}), "give either python"),
        (
            _inv({**BOOT, "jump": "a"}, {**SERVE, "jump": "boot"}),
            "jump hosts form a cycle",
        ),
        (_inv(BOOT, SERVE, ssh={"strict_host_keys": "no"}), "strict_host_keys: 'no'"),
    ],
)
def test_bad_inventories_name_what_is_wrong(data, message):
    with pytest.raises(InventoryError, match=message.replace("(", r"\(")):
        parse_inventory(data)


def test_unreadable_files_are_clear_errors(tmp_path):
    with pytest.raises(InventoryError, match="no inventory file"):
        load_inventory(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[host]\n")
    with pytest.raises(InventoryError, match="not valid TOML"):
        load_inventory(bad)
