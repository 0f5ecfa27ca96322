"""`bench tiles` without a device: flash_mma's tile candidates (each one value from the present
tiles on one axis, the impossible refused with the reason), `tiles_set` changing a role's
instantiation and giving it back, and NVRTC's report on two candidates (the present dk/dv
document tiles compile clean; at 6 blocks an SM the same kernel spills). The timing needs a
device (`jobs/gpu_check.sh ... tiles`)."""
from __future__ import annotations

import pytest

from mpipar.bench import tiles
from mpipar.kernels import cuda_gate, flash_mma

from .test_cuda_gate import needs_nvrtc


@pytest.mark.parametrize("role", tiles.ROLES)
def test_candidates_are_the_present_tiles_and_their_neighbours(role):
    now = flash_mma._tiles(64, role)
    found = flash_mma.tile_candidates(64, role)
    axes = flash_mma.TILE_AXES[flash_mma._base(role)]
    assert found[0] == now and len(set(found)) == len(found)
    for cand in found[1:]:
        moved = [i for i, (a, b) in enumerate(zip(cand, now)) if a != b]
        assert len(moved) == 1 and cand[moved[0]] in axes[moved[0]]
        assert flash_mma.tile_refusal(64, role, cand) is None
    # every neighbour the rules allow is there: count them from the axes and the refusals
    allowed = sum(flash_mma.tile_refusal(64, role, now[:i] + (v,) + now[i + 1:]) is None
                  for i, values in enumerate(axes) for v in values if v != now[i])
    assert len(found) == 1 + allowed


def test_refusals_name_the_rule():
    # Q in registers with two m-tiles: the template's static_assert
    assert "one m-tile" in flash_mma.tile_refusal(64, "fwd", (4, 2, 64, 2, 1))
    # 8 warps x 16 blocks = 4096 threads
    assert "2048 threads" in flash_mma.tile_refusal(64, "dkdv", (8, 32, 16, 0))
    # (64 + 4 x 128 rows) x 144 B = 82,944 B a block, 3 blocks > 228 KiB; 2 fit
    assert flash_mma._smem_bytes(64, "fwd", (4, 1, 128, 3, 0)) == (64 + 4 * 128) * 144
    assert "228 KiB" in flash_mma.tile_refusal(64, "fwd_docs", (4, 1, 128, 3, 0))
    assert flash_mma.tile_refusal(64, "fwd_docs", (4, 1, 128, 2, 0)) is None
    with pytest.raises(ValueError, match="--tiles 4,2,64,2,1 for fwd: .*one m-tile"):
        tiles.candidates(64, "fwd", "4,2,64,2,1")
    # a tuple goes to the roles of its arity only, once
    assert tiles.candidates(64, "fwd_docs", "2,16,8,0 4,1,32,4,0 4,1,32,4,0")[-1] == (4, 1, 32, 4, 0)
    assert (2, 16, 8, 0) in tiles.candidates(64, "dkdv_docs", "2,16,8,0 4,1,32,4,0")


def test_tiles_set_changes_one_role_and_gives_it_back():
    before = {d: dict(t) for d, t in flash_mma._TILES.items()}
    names = flash_mma._names(64)
    with flash_mma.tiles_set(64, "dq_docs", (2, 16, 8, 0)):
        inside = flash_mma._names(64)
        assert inside["dq_docs"] == "flash_bwd_dq<64, 2, 16, 8, false, true, float>"
        assert inside["dq_docs_bf16"] == "flash_bwd_dq<64, 2, 16, 8, false, true, bf16_t>"
        assert {r: n for r, n in inside.items() if not r.startswith("dq_docs")} == \
            {r: n for r, n in names.items() if not r.startswith("dq_docs")}
        assert flash_mma._smem_bytes(64, "dq_docs") == (2 * 32 + 4 * 16) * 144
        assert flash_mma.role_source(64, "dq_docs")["names"] == (inside["dq_docs_bf16"],
                                                                 inside["dq_docs"])
    assert flash_mma._TILES == before and flash_mma._names(64) == names
    with pytest.raises(RuntimeError), flash_mma.tiles_set(64, "fwd", (4, 1, 64, 2, 0)):
        raise RuntimeError   # given back on the way out of an error too
    assert flash_mma._TILES == before


@needs_nvrtc
def test_nvrtc_reports_the_spilling_candidate():
    rows = tiles.compiled(64, "dkdv_docs", [(4, 32, 3, 0), (4, 32, 6, 0)], "sm_90", jobs=1)
    now, six = rows
    assert now["default"] and not now["problems"] and now["spill_bytes"] == 0
    assert now["smem"] == flash_mma._smem_bytes(64, "dkdv_docs") == (2 * 64 + 4 * 32) * 144 + 512
    assert 0 < now["registers"] <= 65536 // (128 * 3)
    # 6 blocks of 128 threads leave 85 registers a thread at most: it spills, and is dropped
    assert six["registers"] <= 65536 // (128 * 6) and six["spill_bytes"] > 0
    assert any("spills" in p for p in six["problems"])


def test_without_a_device_it_skips(capsys, monkeypatch):
    from mpipar.runtime import device

    monkeypatch.setattr(device, "cuda_unavailable", lambda: "no CUDA device here")
    parser = __import__("argparse").ArgumentParser()
    tiles.configure(parser)
    args = parser.parse_args([])
    args.quick = False
    assert tiles.run(args) == {"skipped": "no CUDA device here"}
    assert "--compile-only --arch sm_90" in capsys.readouterr().out
    assert cuda_gate.smem_limit("sm_90") >= flash_mma._smem_bytes(64, "fwd_docs")
