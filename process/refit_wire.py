"""The refit wire: weights from the trainer ranks straight into the rollout engines over torch.distributed, one
layer at a time, without a whole-model copy in any process.

A *refit group* is a process group of its own -- ``senders`` trainer ranks (group ranks ``0 .. M-1``) and the engines
(``M .. M+N-1``) -- made directly over a ``TCPStore`` (:class:`torch.distributed.ProcessGroupGloo` on CPU, NCCL on
GPUs), beside whatever default group each process already runs (the trainers' data-parallel group, vLLM's own).
Trainer rank 0 hosts the store on a port the OS gives it; the caller hands its address to every member; each
formation has a ``generation``, so a group formed again (an engine restarted by Ray) never meets the old one's keys.

One refit (:func:`send` on the trainer ranks, :func:`receive` on the engines, called concurrently):

1. **Manifests.** Each sender broadcasts what it will send (JSON): per bucket (a decoder layer, then the embeddings,
   the final norm and the output projection one each), the pieces -- a tensor's engine-side name, dtype, the shape of
   the piece and the rows ``[row_offset, row_offset + shape[0])`` of the whole tensor it holds (``rows``: the whole
   tensor's dim 0).
2. **Verdicts.** Every member checks the manifests (an engine: the names, shapes and dtypes its model expects; see
   ``verdict`` of :func:`receive`) and an all-reduce tells every member who refused, before any payload moves: a bad
   refit stops on every member with one line, and nothing was loaded.
3. **Payloads.** Per bucket, each sender sends its pieces as one buffer (each at a 16-byte aligned offset), followed
   by an 8-byte checksum of them (``zlib.crc32`` of the bytes on CPU, a position-weighted byte sum on a GPU), to
   every engine, point to point; each engine receives the senders' buffers in rank order and recomputes the
   checksum. This replaces a scan of every received byte: what the sender quantized was checked there. A receiver
   that finds a bad checksum keeps receiving (the senders are in lockstep with it) and reports at the end.
4. **Outcome.** A last all-reduce tells every member whether every engine loaded the refit.

Bytes moved per refit: N x the served state (each engine gets every sender's share once; the trainers exchange
nothing but manifests). Memory: a sender holds one bucket of its shard (its tensors and its buffer), an engine one
bucket (the senders' buffers and the joined tensors) beyond what each holds anyway. FP8 codes travel as bytes (gloo
rejects float8 dtypes); E8M0 scales arrive as ``float8_e8m0fnu`` views of their bytes.
"""
from __future__ import annotations

import datetime
import json
import math
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

__all__ = ["Piece", "RefitGroup", "open_store", "join", "send", "receive", "checksum", "assemble", "manifest_error",
           "pieces_by_name", "node_ip"]

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.uint8,
                                                      torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)}


@dataclass(frozen=True)
class Piece:
    """One tensor of a bucket, or the rows of it that one sender holds."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    row_offset: int = 0
    rows: int | None = None  # the whole tensor's dim 0 (None: the piece is the whole tensor)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPES[self.dtype].itemsize

    @property
    def whole_shape(self) -> tuple[int, ...]:
        return self.shape if self.rows is None else (self.rows, *self.shape[1:])


@dataclass
class RefitGroup:
    """A member's handle on a formed refit group."""

    pg: object
    rank: int
    world: int
    senders: int
    generation: int
    device: torch.device
    store: object = None  # kept alive with the group (rank 0 hosts it)


def node_ip() -> str:
    """This process's address for the group's connections: the Ray node's IP inside a Ray worker, else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def open_store(host: str, world: int, timeout_s: float):
    """A new ``TCPStore`` hosted here on a port the OS picks: ``(store, "host:port")``."""
    import torch.distributed as dist

    store = dist.TCPStore(host, 0, world, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, f"{host}:{store.port}"


def join(address: str, *, rank: int, world: int, senders: int, generation: int, timeout_s: float,
         device: torch.device, host: str | None = None, store=None) -> RefitGroup:
    """Form (or join) the refit group of ``generation`` at ``address``; blocks until all ``world`` members joined.
    ``host``: this member's address for gloo's connections (default :func:`node_ip`). ``store``: the hosted store
    (rank 0), else a client."""
    import torch.distributed as dist

    host = host or node_ip()
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        h, port = address.rsplit(":", 1)
        store = dist.TCPStore(h, int(port), world, False, timeout=timeout)
    prefixed = dist.PrefixStore(f"fp8grpo-refit-{generation}", store)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        pg = dist.ProcessGroupGloo(prefixed, rank, world, opts)
    group = RefitGroup(pg, rank, world, senders, generation, device, store)
    _barrier(group)
    return group


def _barrier(group: RefitGroup) -> None:
    flag = torch.zeros(1, dtype=torch.int64, device=group.device)
    _allreduce_max(group, flag)


def _allreduce_max(group: RefitGroup, t: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    group.pg.allreduce([t], opts).wait()


def _broadcast(group: RefitGroup, t: torch.Tensor, src: int) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    group.pg.broadcast([t], opts).wait()


def _tag(group: RefitGroup, bucket: int, src: int) -> int:
    """The point-to-point tag of ``src``'s buffer of ``bucket`` (the same on both sides)."""
    return bucket * group.senders + src


def checksum(buf: torch.Tensor) -> int:
    """The checksum of a 1-D uint8 buffer: CRC-32 of its bytes on the CPU; on other devices a position-weighted
    byte sum computed there (weights 1..251 cycling; int64, no overflow below ~2**40 bytes)."""
    if buf.device.type == "cpu":
        return zlib.crc32(buf.numpy().data) if buf.numel() else 0
    total = torch.zeros((), dtype=torch.int64, device=buf.device)
    chunk = 1 << 24
    for i in range(0, buf.numel(), chunk):
        c = buf[i:i + chunk].to(torch.int64)
        w = torch.arange(i, i + c.numel(), device=buf.device, dtype=torch.int64).remainder_(251).add_(1)
        total += (c * w).sum()
    return int(total)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8,
                                                                                             device=t.device)


def _layout(pieces: Sequence[Piece]) -> tuple[list[int], int]:
    """Where each piece starts in a bucket's buffer (16-byte aligned, so every piece can be viewed in its dtype)
    and the buffer's size before the checksum (a multiple of 16)."""
    offsets, at = [], 0
    for p in pieces:
        offsets.append(at)
        at += -(-p.nbytes // 16) * 16
    return offsets, at


def _exchange_manifests(group: RefitGroup, own: list[list[Piece]] | None) -> list[list[list[Piece]]]:
    """Every sender's manifest (a list of buckets of pieces), on every member."""
    out = []
    for src in range(group.senders):
        raw = (json.dumps([[asdict(p) for p in bucket] for bucket in own]).encode()
               if group.rank == src else b"")
        n = torch.tensor([len(raw)], dtype=torch.int64, device=group.device)
        _broadcast(group, n, src)
        buf = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(group.device) if group.rank == src
               else torch.empty(int(n), dtype=torch.uint8, device=group.device))
        _broadcast(group, buf, src)
        data = json.loads(bytes(buf.cpu().numpy()).decode())
        out.append([[Piece(p["name"], p["dtype"], tuple(p["shape"]), p["row_offset"], p["rows"]) for p in bucket]
                    for bucket in data])
    return out


def manifest_error(manifests: Sequence[Sequence[Sequence[Piece]]]) -> str | None:
    """What every member checks of the senders' manifests (one line, or None): the same bucket count from every
    sender, and each tensor sent in row pieces tiled exactly by them."""
    if len({len(m) for m in manifests}) > 1:
        return f"refit: the senders' manifests have different bucket counts {[len(m) for m in manifests]}"
    where: dict[str, set[int]] = {}
    for manifest in manifests:
        for b, bucket in enumerate(manifest):
            for piece in bucket:
                where.setdefault(piece.name, set()).add(b)
    split = sorted(n for n, bs in where.items() if len(bs) > 1)
    if split:
        return f"refit: the pieces of {split[0]} are in different buckets {sorted(where[split[0]])}"
    for name, pieces in pieces_by_name(manifests).items():
        if len(pieces) == 1 and pieces[0].rows is None:
            continue
        at, rows = 0, pieces[0].rows
        for p in sorted(pieces, key=lambda p: p.row_offset):
            if p.rows is None or p.rows != rows or p.row_offset != at:
                return f"refit: the pieces of {name} do not tile its {rows} rows (a piece at {p.row_offset}, expected {at})"
            at += p.shape[0]
        if at != rows:
            return f"refit: the row pieces of {name} cover {at} of its {rows} rows"
    return None


def _verdicts(group: RefitGroup, error: str | None, what: str) -> None:
    """All-reduce of every member's verdict; raises on every member if any member refused (naming them)."""
    flags = torch.zeros(group.world, dtype=torch.int64, device=group.device)
    flags[group.rank] = int(error is not None)
    _allreduce_max(group, flags)
    bad = [i for i, f in enumerate(flags.tolist()) if f]
    if error is not None:
        raise ValueError(error)
    if bad:
        names = ", ".join(("trainer rank " if i < group.senders else "engine ") + str(i if i < group.senders else
                                                                                       i - group.senders) for i in bad)
        raise RuntimeError(f"refit: {what} refused by {names} (see that member's error)")


def send(group: RefitGroup, manifest: list[list[Piece]], buckets: Callable[[int], Sequence[torch.Tensor]], *,
         error: str | None = None) -> dict:
    """The sender's side of one refit: ``manifest`` (a list of buckets of pieces) and ``buckets(i)``, the tensors of
    bucket ``i``'s pieces in order, computed at the start of bucket ``i`` on every sender at once (it may run
    collectives of the senders' own group) and dropped after it: one bucket at a time. ``error``: this sender's
    refusal (one line), raised on every member in the verdict round. Returns ``{"bytes": payload bytes this sender
    sent to each engine, "buckets": count, and seconds: "make_s", "checksum_s", "wire_s"}``."""
    manifests = _exchange_manifests(group, manifest)
    _verdicts(group, error or manifest_error(manifests), "the manifest")
    sent, clock = 0, {"make_s": 0.0, "checksum_s": 0.0, "wire_s": 0.0}
    engines = range(group.senders, group.world)
    for b in range(len(manifest)):
        t0 = time.perf_counter()
        tensors = buckets(b)
        clock["make_s"] += time.perf_counter() - t0
        pieces = manifest[b]
        if len(tensors) != len(pieces):
            raise ValueError(f"refit bucket {b}: {len(tensors)} tensors for {len(pieces)} pieces")
        offsets, total = _layout(pieces)
        buf = torch.zeros(total + 8, dtype=torch.uint8, device=group.device)
        for p, t, off in zip(pieces, tensors, offsets, strict=True):
            raw = _bytes_of(t)
            if raw.numel() != p.nbytes:
                raise ValueError(f"refit bucket {b}: {p.name} has {raw.numel()} bytes, the manifest says {p.nbytes}")
            buf[off:off + p.nbytes] = raw
        del tensors
        t1 = time.perf_counter()
        buf[-8:] = torch.tensor([checksum(buf[:-8])], dtype=torch.int64).view(torch.uint8)
        clock["checksum_s"] += time.perf_counter() - t1
        t1 = time.perf_counter()
        for work in [group.pg.send([buf], dst, _tag(group, b, group.rank)) for dst in engines]:
            work.wait()
        clock["wire_s"] += time.perf_counter() - t1
        sent += buf.numel()
        del buf
    _verdicts(group, None, "the loading of the refit")
    return {"bytes": sent, "buckets": len(manifest), **clock}


def receive(group: RefitGroup, verdict: Callable[[list[list[list[Piece]]]], str | None],
            load: Callable[[Iterator[tuple[str, torch.Tensor]]], None]) -> dict:
    """An engine's side of one refit. ``verdict(manifests)``: None to accept, else the one-line reason to refuse
    (every member then stops before any payload). ``load(items)`` consumes ``(name, whole tensor)`` pairs, bucket by
    bucket as they arrive (the engine's weight loader); a tensor's row pieces from several senders are joined.
    A bad checksum stops the loading (the rest is received and dropped) and raises after the outcome round.
    Returns ``{"bytes": payload bytes received, "buckets": count, and seconds: "wire_s", "checksum_s", "load_s"}``."""
    manifests = _exchange_manifests(group, None)
    _verdicts(group, manifest_error(manifests) or verdict(manifests), "the manifest")
    state = {"bytes": 0, "error": None}
    clock = {"wire_s": 0.0, "checksum_s": 0.0}
    n_buckets = len(manifests[0]) if manifests else 0

    def items() -> Iterator[tuple[str, torch.Tensor]]:
        for b in range(n_buckets):
            parts: list[tuple[Piece, torch.Tensor]] = []
            for src in range(group.senders):
                pieces = manifests[src][b]
                offsets, total = _layout(pieces)
                buf = torch.empty(total + 8, dtype=torch.uint8, device=group.device)
                t0 = time.perf_counter()
                group.pg.recv([buf], src, _tag(group, b, src)).wait()
                clock["wire_s"] += time.perf_counter() - t0
                state["bytes"] += buf.numel()
                if state["error"] is not None:
                    continue
                want = int(buf[-8:].view(torch.int64).item())
                t0 = time.perf_counter()
                ok = checksum(buf[:-8]) == want
                clock["checksum_s"] += time.perf_counter() - t0
                if not ok:
                    state["error"] = (f"refit: bucket {b} from trainer rank {src} arrived with a bad checksum "
                                      f"({len(pieces)} tensors, {buf.numel() - 8} bytes): the engine's weights are "
                                      "incomplete until the next refit")
                    continue
                for p, off in zip(pieces, offsets, strict=True):
                    parts.append((p, buf[off:off + p.nbytes].view(_DTYPES[p.dtype]).view(p.shape)))
            if state["error"] is None:
                yield from assemble(parts)

    it = items()
    t0 = time.perf_counter()
    load(it)
    for _ in it:  # drain what the loader did not take (after an error): the senders are in lockstep
        pass
    clock["load_s"] = time.perf_counter() - t0 - clock["wire_s"] - clock["checksum_s"]  # the loader's own time
    _verdicts(group, state["error"], "the loading of the refit")
    return {"bytes": state["bytes"], "buckets": n_buckets, **clock}


def assemble(parts: Sequence[tuple[Piece, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, whole tensor)`` for the pieces of one bucket, in the order names first appear: a whole piece as it
    is, row pieces joined in row order (:func:`manifest_error` checked that they tile the whole tensor's rows)."""
    by_name: dict[str, list[tuple[Piece, torch.Tensor]]] = {}
    for p, t in parts:
        by_name.setdefault(p.name, []).append((p, t))
    for name, pieces in by_name.items():
        if len(pieces) == 1:
            yield name, pieces[0][1]
        else:
            yield name, torch.cat([t for _, t in sorted(pieces, key=lambda pt: pt[0].row_offset)])


def pieces_by_name(manifests: Sequence[Sequence[Sequence[Piece]]]) -> Mapping[str, list[Piece]]:
    """Every piece of every sender's manifest, by name (for a receiver's verdict)."""
    out: dict[str, list[Piece]] = {}
    for manifest in manifests:
        for bucket in manifest:
            for p in bucket:
                out.setdefault(p.name, []).append(p)
    return out
