"""process.refit_wire over real gloo groups of spawned processes: two senders (trainer ranks) and two receivers
(engines) in a group of their own, each process also running a default group of its own as trainers and vLLM do;
row pieces joined, whole pieces passed, the manifest refused by an engine stops every member before any payload, a
bad checksum is found and reported on every member, a dead member fails the others within the timeout."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from process import refit_wire
from process.refit_wire import Piece

pytestmark = pytest.mark.slow  # four spawned processes

W = torch.arange(300 * 16, dtype=torch.float32).reshape(300, 16) / 7  # sent in row pieces: rows [0, 150), [150, 300)
CODES = torch.arange(64, dtype=torch.uint8).reshape(8, 8)  # a whole piece from sender 0
NORM = torch.linspace(0, 1, 33).to(torch.bfloat16)  # a whole piece from sender 1


def _manifest(rank: int) -> tuple[list[list[Piece]], list[list[torch.Tensor]]]:
    rows = slice(0, 150) if rank == 0 else slice(150, 300)
    layer0 = [Piece("layer0.w", "float32", (150, 16), rows.start, 300)]
    layer0_t = [W[rows]]
    if rank == 0:
        layer0.append(Piece("layer0.codes", "uint8", (8, 8)))
        layer0_t.append(CODES)
    rest = [Piece("norm", "bfloat16", (33,))] if rank == 1 else []
    rest_t = [NORM] if rank == 1 else []
    return [layer0, rest], [layer0_t, rest_t]


def _member(rank: int, world: int, tmp: str, modes: tuple[str, ...]) -> None:
    import torch.distributed as dist

    # a default group of its own (the trainers' data-parallel group, vLLM's world of one), as in the pipeline
    dist.init_process_group("gloo", init_method=f"file://{tmp}/own{rank}", rank=0, world_size=1)
    if rank == 0:
        store, address = refit_wire.open_store("127.0.0.1", world, 20)
        (Path(tmp) / "address").write_text(address)
    else:
        store = None
        while not (Path(tmp) / "address").exists():
            time.sleep(0.05)
        address = (Path(tmp) / "address").read_text()
    group = refit_wire.join(address, rank=rank, world=world, senders=2, generation=3, timeout_s=20,
                            device=torch.device("cpu"), store=store)
    checksum = refit_wire.checksum
    for mode in modes:  # one refit per mode, on the same group
        out = Path(tmp) / f"{mode}-rank{rank}.txt"
        refit_wire.checksum = (lambda buf: 12345) if mode == "corrupt" and rank == 1 else checksum
        t0 = time.monotonic()
        try:
            if rank < 2:
                manifest, tensors = _manifest(rank)
                r = refit_wire.send(group, manifest, lambda b, tensors=tensors: tensors[b])
                out.write_text(f"ok {r['bytes']}")
            else:
                if mode == "dead" and rank == 3:
                    os._exit(0)  # dies after the group formed, before the refit
                loaded: dict[str, torch.Tensor] = {}

                def verdict(manifests, mode=mode):
                    return "engine says no: layer0.w is not ours" if mode == "refuse" and rank == 2 else None

                def load(items, loaded=loaded):
                    for name, t in items:
                        loaded[name] = t.clone()

                r = refit_wire.receive(group, verdict, load)
                same = (torch.equal(loaded["layer0.w"], W) and torch.equal(loaded["layer0.codes"], CODES)
                        and torch.equal(loaded["norm"], NORM) and len(loaded) == 3)
                out.write_text(f"ok {r['bytes']} {same}")
        except Exception as e:  # noqa: BLE001 - the outcome is what the test reads
            out.write_text(f"{type(e).__name__} {time.monotonic() - t0:.1f} {e}")


MODES = ("ok", "refuse", "corrupt", "dead")  # in this order on one group of four spawned processes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict[int, str]]:
    """Every mode's outcome per member: ``{mode: {rank: line}}`` (a member that died wrote none)."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("refit-wire")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_member, args=(r, 4, str(tmp), MODES)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        assert p.exitcode is not None, "a member hung"
    return {m: {r: (tmp / f"{m}-rank{r}.txt").read_text() for r in range(4) if (tmp / f"{m}-rank{r}.txt").exists()}
            for m in MODES}


def test_pieces_from_two_senders_arrive_whole_at_both_engines(outcomes):
    out = outcomes["ok"]
    payload = W.numel() * 4 + CODES.numel() + 80  # the norm's 66 bytes padded to 16
    assert out[2] == out[3] == f"ok {payload + 4 * 8} True", out  # 4 buffers (2 senders x 2 buckets), 8-byte checksums
    assert out[0].startswith("ok") and out[1].startswith("ok"), out


def test_an_engine_refusing_the_manifest_stops_every_member_before_any_payload(outcomes):
    out = outcomes["refuse"]
    assert out[2].startswith("ValueError") and "engine says no: layer0.w is not ours" in out[2], out
    for r in (0, 1, 3):
        assert out[r].startswith("RuntimeError") and "the manifest refused by engine 0" in out[r], out


def test_a_bad_checksum_is_found_and_every_member_is_told(outcomes):
    out = outcomes["corrupt"]
    for r in (2, 3):
        assert out[r].startswith("ValueError") and "from trainer rank 1 arrived with a bad checksum" in out[r], out
    for r in (0, 1):
        assert "the loading of the refit refused by engine 0, engine 1" in out[r], out


def test_a_dead_engine_fails_the_others_within_the_timeout(outcomes):
    out = outcomes["dead"]
    assert 3 not in out
    for r in (0, 1, 2):
        kind, seconds, _ = out[r].split(" ", 2)
        assert kind != "ok" and float(seconds) < 25, out
