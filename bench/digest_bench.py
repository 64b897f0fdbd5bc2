"""Digest encodings compared: bytes per cached block, false-positive rate, encode/decode time.

Run: ``python bench/digest_bench.py`` (about 10 s on one core). Prints a table and writes
``bench/results/digest.json``. Candidates for the set of cached 64-bit block hashes:
- raw: 8 bytes per hash (exact);
- varint: sorted full hashes, delta-encoded as LEB128 varints (exact);
- rice64: sorted full hashes, Golomb-Rice coded (exact);
- rice32 / rice24: top 32 / 24 bits (fingerprints), Golomb-Rice coded (approximate; what
  ``overlay.digest`` ships, 32 bits by default);
- bloom1%: a Bloom filter sized for 1 % false positives (approximate, no removals, so no deltas).
The sealed figure is a whole signed full digest (CBOR envelope) with the shipped encoding.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

from p2pnode.overlay.cache.digest import (
    DigestBuilder,
    decode_fingerprints,
    encode_fingerprints,
    fingerprint,
)

SIZES = (1_000, 10_000, 100_000)
QUERIES = 20_000


def varint_delta(sorted_values: list[int]) -> bytes:
    out = bytearray()
    prev = 0
    for v in sorted_values:
        d = v - prev
        prev = v
        while True:
            byte = d & 0x7F
            d >>= 7
            if d:
                out.append(byte | 0x80)
            else:
                out.append(byte)
                break
    return bytes(out)


def bloom_bytes_and_fp(hashes: list[int], queries: list[int], p: float = 0.01) -> tuple[int, float]:
    n = len(hashes)
    m = math.ceil(-n * math.log(p) / math.log(2) ** 2)
    k = max(1, round(m / n * math.log(2)))
    bits = bytearray((m + 7) // 8)

    def positions(h: int) -> list[int]:
        h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1
        return [(h1 + i * h2) % m for i in range(k)]

    for h in hashes:
        for pos in positions(h):
            bits[pos >> 3] |= 1 << (pos & 7)
    hits = sum(all(bits[pos >> 3] >> (pos & 7) & 1 for pos in positions(q)) for q in queries)
    return len(bits), hits / len(queries)


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def bench_size(n: int, rng: random.Random) -> dict:
    hashes = [rng.getrandbits(64) for _ in range(n)]
    queries = [rng.getrandbits(64) for _ in range(QUERIES)]  # almost surely not members
    ordered = sorted(hashes)
    row: dict = {"blocks": n, "bytes_per_block": {}, "false_positive_rate": {}, "seconds": {}}
    row["bytes_per_block"]["raw"] = 8.0
    row["bytes_per_block"]["varint"] = len(varint_delta(ordered)) / n
    for bits in (64, 32, 24):
        fps = [fingerprint(h, bits) for h in hashes]
        (count, k, data), t_enc = timed(encode_fingerprints, fps, bits)
        decoded, t_dec = timed(decode_fingerprints, count, k, data, bits)
        assert decoded == sorted(set(fps)), "round trip failed"
        members = set(decoded)
        fp_rate = sum(fingerprint(q, bits) in members for q in queries) / QUERIES
        name = f"rice{bits}"
        row["bytes_per_block"][name] = len(data) / n
        row["false_positive_rate"][name] = fp_rate
        row["seconds"][f"{name}_encode"] = t_enc
        row["seconds"][f"{name}_decode"] = t_dec
    (size, fp_rate), t_bloom = timed(bloom_bytes_and_fp, hashes, queries)
    row["bytes_per_block"]["bloom1%"] = size / n
    row["false_positive_rate"]["bloom1%"] = fp_rate
    row["seconds"]["bloom1%_build_and_query"] = t_bloom

    builder = DigestBuilder("bench-peer", "bench-model")
    builder.sync(hashes)
    try:
        from p2pnode.identity import NodeKey
        from p2pnode.overlay.cache.digest import seal_digest

        sealed = seal_digest(NodeKey.generate(), builder.full())
        row["bytes_per_block"]["sealed_full_digest"] = len(sealed) / n
    except ImportError:
        row["bytes_per_block"]["sealed_full_digest"] = None
    except Exception as exc:  # e.g. over the 256 KiB digest limit at 100k blocks
        row["sealed_error"] = str(exc)
    return row


def bench_delta(rng: random.Random) -> dict:
    """A typical delta: one 512-token prompt stored (32 blocks), 32 older blocks evicted."""
    builder = DigestBuilder("bench-peer", "bench-model")
    builder.sync(rng.getrandbits(64) for _ in range(10_000))
    base = builder.cut()
    old = list(builder._hashes)[:32]
    from p2pnode.inference.blockhash import BlockRemoved, BlockStored

    builder.on_event(BlockStored(tuple(rng.getrandbits(64) for _ in range(32)), None))
    builder.on_event(BlockRemoved(tuple(old)))
    delta = builder.delta_since(base)
    a = encode_fingerprints(delta.added, delta.fp_bits)[2]
    r = encode_fingerprints(delta.removed, delta.fp_bits)[2]
    return {"changed_blocks": 64, "set_bytes": len(a) + len(r)}


def main() -> None:
    rng = random.Random(1234)
    rows = [bench_size(n, rng) for n in SIZES]
    delta = bench_delta(rng)
    names = list(rows[0]["bytes_per_block"])
    print("bytes per cached block")
    print(f"{'encoding':>20} " + " ".join(f"{r['blocks']:>10}" for r in rows))
    for name in names:
        cells = []
        for r in rows:
            v = r["bytes_per_block"].get(name)
            cells.append(f"{v:>10.3f}" if v is not None else f"{'n/a':>10}")
        print(f"{name:>20} " + " ".join(cells))
    print("false positive rate per absent-block lookup")
    for name in rows[0]["false_positive_rate"]:
        print(f"{name:>20} " + " ".join(f"{r['false_positive_rate'][name]:>10.5f}" for r in rows))
    print("seconds")
    for name in rows[0]["seconds"]:
        print(f"{name:>20} " + " ".join(f"{r['seconds'][name]:>10.4f}" for r in rows))
    for r in rows:
        if "sealed_error" in r:
            print(f"{r['blocks']} blocks: {r['sealed_error']}")
    print(f"delta of 32 stored + 32 evicted blocks (of 10k): {delta['set_bytes']} bytes of sets")
    out = Path(__file__).resolve().parent / "results" / "digest.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"sizes": rows, "delta": delta, "queries": QUERIES}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
