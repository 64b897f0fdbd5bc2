"""Long, coverage-guided fuzzing of every decoder and handler that takes bytes from the network.

    python bench/fuzz_long.py --seconds 180                 # every target, 3 min each
    python bench/fuzz_long.py --seconds 60 --targets frame,digest_payload

Each target runs in its own process under atheris (libFuzzer; ``pip install -e '.[fuzz]'``),
seeded with valid inputs, instrumented over ``p2pnode`` only. An input may raise only the
target's own error types (WireError, IdentityError, DigestError, VerifierError, ForwardFailed,
PullFailed); anything else is a crash: recorded (deduplicated by exception type and innermost
p2pnode frame, the input saved under bench/results/fuzz_crashes/) and fuzzing goes on. An input
running past ``--input-timeout`` s is a hang (libFuzzer stops that target and saves it). Handler
targets check every 25th input that the server still answers a valid request.

Without atheris the same targets run under a plain random-mutation loop (not coverage guided;
said so in the output). Prints per target: inputs tried, distinct crashes, and writes
bench/results/fuzz_long.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
# The stream-feed harness is the decoder fuzz tests' own (tests/testkit/streams.py).
sys.path.insert(0, str(ROOT.parent / "tests"))
RESULTS = ROOT / "results"
CRASH_DIR = RESULTS / "fuzz_crashes"
CORPUS_DIR = RESULTS / "fuzz_corpus"
TARGETS = (
    "frame",
    "envelope",
    "node_record",
    "fingerprints",
    "digest_payload",
    "digest_bytes",
    "digest_ingest",
    "forward_messages",
    "forward_handler",
    "forward_client",
    "verify_messages",
    "verify_handler",
    "pull_server",
    "pull_client",
)
CHECK_EVERY = 25


# ----------------------------------------------------------------------------- child side


class Harness:
    """The targets; built after atheris starts instrumenting ``p2pnode`` imports."""

    def __init__(self, name: str, stats_path: Path) -> None:
        self.name = name
        self.stats_path = stats_path
        self.tried = 0
        self.outcomes: dict[str, int] = {}
        self.crashes: dict[str, dict[str, Any]] = {}
        self._last_write = 0.0
        self._model: Any = None
        self._setup()

    # -- shared pieces

    def _setup(self) -> None:
        import trio
        import trio.testing

        from p2pnode import identity
        from p2pnode.identity import plaincbor
        from p2pnode.overlay import antientropy, digest, forward, limits, views, wire
        from p2pnode.speculation import protocol, verify

        from testkit import streams  # imported here, so atheris instruments the p2pnode it uses

        self.trio, self.identity, self.plaincbor = trio, identity, plaincbor
        self.streams = streams
        self.wire, self.digest, self.views, self.limits = wire, digest, views, limits
        self.forward, self.ae, self.protocol, self.verify = forward, antientropy, protocol, verify
        self.now = time.time()
        self.key = identity.NodeKey.from_seed(b"\x07" * 32)
        self.peer_key = identity.NodeKey.from_seed(b"\x09" * 32)
        self.model_id = "fuzz-model@0"

    def valid_digest(self, base: int | None = None) -> Any:
        return self.digest.Digest(
            peer_id=self.peer_key.peer_id,
            model_id=self.model_id,
            epoch=7,
            version=3,
            base_version=base,
            fp_bits=32,
            added=frozenset(range(5, 40, 3)) if base is None else frozenset(range(100, 110)),
            removed=frozenset() if base is None else frozenset({1, 2}),
            cleared=False,
            load=self.digest.LoadInfo(2, 0.5, False, 0.001, 0.05),
        )

    def model(self) -> Any:
        if self._model is None:
            import torch

            from p2pnode.inference.models import load_model

            torch.set_num_threads(1)
            self._model = load_model(None)
        return self._model

    # -- seeds (valid inputs each target starts from)

    def seeds(self) -> list[bytes]:
        w, d, fwd, p, ae = self.wire, self.digest, self.forward, self.protocol, self.ae
        frame = self.streams.frame_bytes
        sealed = self.digest.seal_digest(self.peer_key, self.valid_digest(), now=self.now)
        fl, vl, dl = (
            w.limit_for(x) for x in (fwd.FORWARD_PROTOCOL, p.VERIFY_PROTOCOL, ae.DIGEST_PROTOCOL)
        )
        req = fwd.ForwardRequest(model_id=self.model_id, prompt=[10, 11, 12], max_tokens=3)
        if self.name == "forward_handler":
            req = dataclasses.replace(req, model_id=self.model().model_id, deadline_s=5.0)
        vopen = p.VerifyOpen(self.model_id, [1, 2, 3])
        if self.name == "verify_handler":
            vopen = dataclasses.replace(vopen, model_id=self.model().model_id)
        block = p.VerifyBlock(0, 3, 3, [4, 5])
        count, k, fps = d.encode_fingerprints(range(0, 1 << 32, 1 << 26), 32)
        by_target = {
            "frame": [frame(req, fl), frame(block, vl)],
            "envelope": [sealed],
            "node_record": [
                self.identity.sign_node_record(
                    self.key,
                    self.identity.new_node_record(
                        self.key, ["/ip4/127.0.0.1/tcp/1"], ["m"], ["router"], {"slots": 2}, "0.1"
                    ),
                )
            ],
            "fingerprints": [bytes([count & 0xFF, count >> 8, k, 32]) + fps],
            "digest_payload": [
                self.plaincbor.encode(d.digest_to_payload(self.valid_digest(base)))
                for base in (None, 2)
            ],
            "digest_bytes": [sealed],
            "digest_ingest": [sealed],
            "forward_messages": [
                frame(m, fl)
                for m in (
                    req,
                    fwd.ForwardAccepted(0, 0),
                    fwd.ForwardTokens(0, [5]),
                    fwd.ForwardDone(1, "length", 0, 3, 0, 0),
                    fwd.ForwardError("busy", "x"),
                )
            ],
            "forward_handler": [frame(req, fl)],
            "forward_client": [
                frame(fwd.ForwardAccepted(0, 0), fl)
                + frame(fwd.ForwardTokens(0, [5, 6]), fl)
                + frame(fwd.ForwardDone(2, "length", 0, 3, 0, 0), fl)
            ],
            "verify_messages": [
                frame(block, vl),
                frame(p.VerifyBlock(0, 3, 3, [4, 5], 2, bytes(16), bytes(16)), vl),
                frame(vopen, vl),
            ],
            "verify_handler": [frame(vopen, vl) + frame(block, vl)],
            "pull_server": [frame(ae.DigestPull(self.model_id, 7, 1), dl)],
            "pull_client": [frame(ae.DigestReply(sealed), dl)],
        }
        return by_target[self.name]

    # -- targets: each returns a short outcome label; allowed errors are caught here

    def t_frame(self, data: bytes) -> str:
        try:
            obj = self.wire.decode_frame(data, limit=1 << 20)
            self.wire.from_wire(obj)
        except self.wire.WireError:
            return "refused"
        return "accepted"

    def t_envelope(self, data: bytes) -> str:
        try:
            self.identity.open_envelope(data, "digest", now=self.now)
        except self.identity.IdentityError:
            return "refused"
        return "accepted"

    def t_node_record(self, data: bytes) -> str:
        try:
            self.identity.verify_node_record(data)
        except self.identity.IdentityError:
            return "refused"
        return "accepted"

    def t_fingerprints(self, data: bytes) -> str:
        if len(data) < 4:
            return "short"
        count, k, bits = data[0] | data[1] << 8, data[2] - 2, 16 + data[3] % 49
        try:
            out = self.digest.decode_fingerprints(count, k, data[4:], bits)
        except self.digest.DigestError:
            return "refused"
        assert len(out) == count and out == sorted(set(out)), "decoded set not sorted/unique"
        assert all(0 <= x < 1 << bits for x in out), "fingerprint out of range"
        return "accepted"

    def _apply(self, digest: Any) -> None:
        pv = self.views.PeerViews()
        pv.apply(dataclasses.replace(self.valid_digest(), version=2, timestamp=self.now))
        pv.apply(digest)
        for view in pv.views():
            assert all(0 <= fp < 1 << view.fp_bits for fp in view.fingerprints), "view corrupt"

    def t_digest_payload(self, data: bytes) -> str:
        try:
            payload = self.plaincbor.decode(data)
            sealed = self.identity.seal(self.peer_key, "digest", payload, now=self.now)
        except (self.plaincbor.PlainCBORError, self.identity.IdentityError):
            return "not_plain"
        try:
            digest = self.digest.open_digest(sealed, now=self.now)
        except self.digest.DigestError as exc:
            assert exc.reason in self.digest.DROP_REASONS, f"unknown reason {exc.reason}"
            return "refused"
        self._apply(digest)
        return "accepted"

    def t_digest_bytes(self, data: bytes) -> str:
        try:
            self._apply(self.digest.open_digest(data, now=self.now))
        except self.digest.DigestError:
            return "refused"
        return "accepted"

    def t_digest_ingest(self, data: bytes) -> str:
        ae = self.ae.AntiEntropy(
            self.streams.StubNode("me"), self.key, self.views.PeerViews(), models=[self.model_id]
        )

        async def main() -> Any:
            return ae.ingest(
                data, model=self.model_id, source="gossip", expected_peer=self.peer_key.peer_id
            )

        result = self.trio.run(main)
        return "dropped" if result is None else result.value

    def t_forward_messages(self, data: bytes) -> str:
        f = self.forward
        types = (
            f.ForwardRequest,
            f.ForwardAccepted,
            f.ForwardTokens,
            f.ForwardDone,
            f.ForwardError,
        )
        try:
            msg = self.wire.from_wire(self.wire.decode_frame(data, limit=1 << 22), *types)
        except self.wire.WireError:
            return "refused"
        assert self.wire.from_wire(self.wire.to_wire(msg), *types) == msg, "no round trip"
        return "accepted"

    def t_forward_handler(self, data: bytes) -> str:
        from p2pnode.inference.engine import open_engine

        f, wire, limit = self.forward, self.wire, self.wire.limit_for(self.forward.FORWARD_PROTOCOL)
        check = self.tried % CHECK_EVERY == 0
        seed = self.seeds()[0] if check else b""

        async def main() -> str:
            async with open_engine(
                self.model(), backend="emulated", calibrate_cost=False, torch_threads=1
            ) as e:
                e.cost.prefill_s_per_token = e.cost.decode_s_per_token = e.cost.overhead_s = 0.0
                server = f.ForwardServer(e, limiter=self.limits.PeerLimiter())
                with self.trio.fail_after(30):
                    out, raised = await self.streams.feed(server.handle, data)
                if raised is not None and not isinstance(raised, wire.WireError):
                    raise raised
                replies = [wire.from_wire(o) for o in self.streams.read_frames(out, limit)]
                assert e.queue_depth == 0, "engine slot leaked"
                if check:
                    out, raised = await self.streams.feed(server.handle, seed)
                    last = [wire.from_wire(o) for o in self.streams.read_frames(out, limit)][-1]
                    assert raised is None and isinstance(last, f.ForwardDone), "stopped serving"
                return type(replies[-1]).__name__ if replies else "silent"

        return self.trio.run(main)

    def t_forward_client(self, data: bytes) -> str:
        f = self.forward
        req = f.ForwardRequest(model_id=self.model_id, prompt=[1, 2], max_tokens=3)

        async def main() -> str:
            client, server = self.trio.testing.memory_stream_pair()
            await server.send_all(data)
            await server.send_eof()
            try:
                with self.trio.fail_after(30):
                    out = await f.forward_request(
                        self.streams.StubNode("me", client),
                        "peer",
                        req,
                        accept_timeout_s=5,
                        first_token_timeout_s=5,
                        idle_timeout_s=5,
                    )
            except f.ForwardFailed as exc:
                return f"failed:{exc.reason}"
            assert len(out.tokens) == out.done.n_tokens <= req.max_tokens, "token count"
            return "accepted"

        return self.trio.run(main)

    def t_verify_messages(self, data: bytes) -> str:
        p = self.protocol
        types = (
            p.VerifyOpen,
            p.VerifyBlock,
            p.VerifyOpened,
            p.VerifyResult,
            p.VerifyRefused,
            p.VerifyClose,
        )
        try:
            msg = self.wire.from_wire(self.wire.decode_frame(data, limit=p.LIMIT), *types)
            if isinstance(msg, p.VerifyBlock):
                p.decode_q(msg, 64)
        except (self.wire.WireError, self.verify.VerifierError):
            return "refused"
        return "accepted"

    def t_verify_handler(self, data: bytes) -> str:
        p, wire = self.protocol, self.wire
        check = self.tried % CHECK_EVERY == 0
        seed = self.seeds()[0]
        verifier = self.verify.BatchedVerifier(self.model(), max_sessions=4, idle_timeout_s=30)
        cfg = self.limits.LimitsConfig(verify=self.limits.Budget(1e6, 1e6, 8, 64))
        limiter = self.limits.PeerLimiter(cfg)

        async def serve(stream: Any) -> None:
            await p.serve_limited(stream, verifier, limiter)

        async def main() -> str:
            async with self.trio.open_nursery() as nursery:
                await nursery.start(verifier.run)
                with self.trio.fail_after(60):
                    out, raised = await self.streams.feed(serve, data)
                if raised is not None:
                    raise raised
                replies = [wire.from_wire(o) for o in self.streams.read_frames(out, p.LIMIT)]
                assert not verifier.sessions, "session leaked"
                assert limiter.usage("unknown-peer")["bytes"] == 0, "bytes leaked"
                if check:
                    out, raised = await self.streams.feed(serve, seed)
                    got = [wire.from_wire(o) for o in self.streams.read_frames(out, p.LIMIT)]
                    assert raised is None and isinstance(got[-1], p.VerifyResult), "stopped serving"
                nursery.cancel_scope.cancel()
            return type(replies[-1]).__name__ if replies else "silent"

        return self.trio.run(main)

    def t_pull_server(self, data: bytes) -> str:
        builder = self.digest.DigestBuilder(self.key.peer_id, self.model_id, epoch=7)
        builder.sync(range(1 << 40, (1 << 40) + 50 * (1 << 33), 1 << 33))
        ae = self.ae.AntiEntropy(
            self.streams.StubNode("me"),
            self.key,
            self.views.PeerViews(),
            builders={self.model_id: builder},
        )
        limit = self.wire.limit_for(self.ae.DIGEST_PROTOCOL)

        async def main() -> str:
            out, raised = await self.streams.feed(ae._serve_pull, data)
            if raised is not None and not isinstance(raised, self.wire.WireError):
                raise raised
            replies = [self.wire.from_wire(o) for o in self.streams.read_frames(out, limit)]
            return type(replies[-1]).__name__ if replies else "refused"

        return self.trio.run(main)

    def t_pull_client(self, data: bytes) -> str:
        async def main() -> str:
            client, server = self.trio.testing.memory_stream_pair()
            await server.send_all(data)
            await server.send_eof()
            ae = self.ae.AntiEntropy(
                self.streams.StubNode("me", client),
                self.key,
                self.views.PeerViews(),
                models=[self.model_id],
            )
            try:
                with self.trio.fail_after(30):
                    result = await ae.pull(self.peer_key.peer_id, self.model_id)
            except self.ae.PullFailed:
                return "failed"
            return "dropped" if result is None else result.value

        return self.trio.run(main)

    # -- driver

    def one(self, data: bytes) -> None:
        self.tried += 1
        try:
            outcome = getattr(self, "t_" + self.name)(data)
        except Exception as exc:  # anything the target did not allow: a crash
            outcome = "CRASH"
            self._record_crash(exc, data)
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        now = time.monotonic()
        if now - self._last_write > 1.0:
            self.write_stats()

    def _record_crash(self, exc: BaseException, data: bytes) -> None:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/work/" in f.filename]
        where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
        sig = f"{type(exc).__name__} at {where}"
        if sig in self.crashes:
            self.crashes[sig]["count"] += 1
            return
        CRASH_DIR.mkdir(parents=True, exist_ok=True)
        path = CRASH_DIR / f"{self.name}-{len(self.crashes)}.bin"
        path.write_bytes(data)
        self.crashes[sig] = {"count": 1, "input": str(path), "message": str(exc)[:300]}
        print(f"[{self.name}] CRASH {sig}: {str(exc)[:200]} (input {path})", flush=True)
        self.write_stats()

    def write_stats(self) -> None:
        self._last_write = time.monotonic()
        stats = {"tried": self.tried, "outcomes": self.outcomes, "crashes": self.crashes}
        self.stats_path.write_text(json.dumps(stats))


def child(name: str, stats_path: Path, seconds: float, input_timeout: int) -> None:
    try:
        import atheris
    except ImportError:
        atheris = None
    if atheris is None:
        harness = Harness(name, stats_path)
        _random_loop(harness, seconds)
        return
    with atheris.instrument_imports(include=["p2pnode"]):
        harness = Harness(name, stats_path)
    corpus = CORPUS_DIR / name
    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(harness.seeds()):
        (corpus / f"seed-{i}").write_bytes(seed)
    harness.write_stats()
    args = [
        sys.argv[0],
        f"-max_total_time={int(seconds)}",
        f"-timeout={input_timeout}",
        "-rss_limit_mb=6144",
        "-max_len=4096",
        "-print_final_stats=1",
        f"-artifact_prefix={CRASH_DIR}/{name}-",
        str(corpus),
    ]
    CRASH_DIR.mkdir(parents=True, exist_ok=True)
    atheris.Setup(args, harness.one)
    atheris.Fuzz()


def _random_loop(harness: Harness, seconds: float) -> None:
    """Fallback without atheris: random byte mutations of the seeds (no coverage feedback)."""
    rng = random.Random(8)
    seeds = harness.seeds()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 6)):
            pos = rng.randrange(len(data) + 1)
            op = rng.randrange(4)
            if op == 0 and data:
                data[min(pos, len(data) - 1)] ^= 1 << rng.randrange(8)
            elif op == 1:
                data[pos:pos] = rng.randbytes(rng.randint(1, 8))
            elif op == 2:
                del data[pos : pos + rng.randint(1, 8)]
            else:
                data = data[:pos]
        harness.one(bytes(data))
    harness.write_stats()


# ----------------------------------------------------------------------------- parent side


def run_target(name: str, seconds: float, input_timeout: int) -> dict[str, Any]:
    stats_path = RESULTS / f"fuzz_stats_{name}.json"
    stats_path.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        __file__,
        "--child",
        name,
        "--seconds",
        str(seconds),
        "--input-timeout",
        str(input_timeout),
    ]
    started = time.monotonic()
    # Start-up (imports, a model load for handler targets) is not part of the budget.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 300)
    wall = time.monotonic() - started
    log = proc.stdout + proc.stderr
    stats: dict[str, Any] = {"tried": 0, "outcomes": {}, "crashes": {}}
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        stats = json.loads(stats_path.read_text())
    executed = re.findall(r"stat::number_of_executed_units:\s*(\d+)", log)
    coverage = re.findall(r"cov: (\d+) ft: (\d+)", log)
    hangs = "ERROR: libFuzzer: timeout" in log
    return {
        "target": name,
        "inputs": int(executed[-1]) if executed else stats["tried"],
        "seconds": round(wall, 1),
        "coverage_edges": int(coverage[-1][0]) if coverage else None,
        "outcomes": stats["outcomes"],
        "crashes": stats["crashes"],
        "hang": hangs,
        "exit_code": proc.returncode,
        "log_tail": log[-1500:] if proc.returncode not in (0,) or hangs else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="fuzzing time per target")
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated subset")
    parser.add_argument("--input-timeout", type=int, default=60, help="s before an input is a hang")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.child:
        child(
            args.child, RESULTS / f"fuzz_stats_{args.child}.json", args.seconds, args.input_timeout
        )
        return
    names = [t for t in args.targets.split(",") if t]
    unknown = set(names) - set(TARGETS)
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}; known: {', '.join(TARGETS)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    try:
        import atheris  # noqa: F401

        engine = "atheris (libFuzzer, coverage guided)"
    except ImportError:
        engine = "random mutation (atheris not installed: pip install -e '.[fuzz]')"
    print(f"fuzzing with {engine}, {args.seconds:.0f} s per target; load {os.getloadavg()}")
    rows = []
    for name in names:
        row = run_target(name, args.seconds, args.input_timeout)
        rows.append(row)
        crashes = sum(c["count"] for c in row["crashes"].values())
        print(
            f"{name:17s} {row['inputs']:>9,d} inputs  {len(row['crashes'])} distinct crashes"
            f" ({crashes} inputs){'  HANG' if row['hang'] else ''}  cov {row['coverage_edges']}"
            f"  exit {row['exit_code']}  {row['outcomes']}",
            flush=True,
        )
        for sig, info in row["crashes"].items():
            print(f"    {sig}: {info['message'][:160]}  -> {info['input']}")
        if row["log_tail"] and row["exit_code"] not in (0,):
            print("    log tail:", row["log_tail"][-600:].replace("\n", "\n    "))
    out = RESULTS / "fuzz_long.json"
    out.write_text(
        json.dumps(
            {
                "engine": engine,
                "seconds_per_target": args.seconds,
                "load": os.getloadavg(),
                "targets": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
