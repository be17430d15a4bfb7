"""bench.refit: its table (ratio to the object store per size, MB columns) and its argument checks. The measurement
itself runs the pipeline's refit task on real workers (``python -m bench.refit``; results in docs/results)."""
import pytest

from bench.refit import main, table


def _row(size, transport, seconds, served=2**20, moved=3 * 2**20, loader="in_place"):
    return {"size": size, "params": 2.9e6, "transport": transport, "loader": loader, "engines": 2, "trainers": 2,
            "seconds": seconds, "parts_s": {"load": seconds / 2}, "served_bytes": served, "moved_bytes": moved,
            "trainer_peak_add": 2**21, "engine_peak_add": 2**22}


def test_table_gives_each_row_its_speed_over_the_object_store_of_its_size_with_the_same_loader():
    rows = [_row("small", "collective", 0.25), _row("small", "object_store", 1.0), _row("large", "collective", 2.0),
            _row("large", "object_store", 3.0), _row("large", "collective", 6.0, loader="vllm_reload"),
            _row("large", "object_store", 12.0, loader="vllm_reload")]
    lines = table(rows).splitlines()
    assert lines[2].startswith("| small | 2.9M | collective | in_place | 2 x 2 | 0.250 | 0.125 | 4.00x | 1.0 | 3.0 | "
                               "2.0 | 4.0 |")
    assert "| object_store | in_place | 2 x 2 | 1.000 | 0.500 |  |" in lines[3]
    assert "| 2.000 | 1.000 | 1.50x |" in lines[4]
    assert "| vllm_reload | 2 x 2 | 6.000 | 3.000 | 0.50x |" in lines[6]  # against the in-place object store
    assert "| vllm_reload | 2 x 2 | 12.000 | 6.000 | 0.25x |" in lines[7]


@pytest.mark.parametrize("argv,message", [(["--sizes", "huge"], "--sizes: unknown"),
                                          (["--engines", "0"], "must be >= 1")])
def test_bad_arguments_are_one_line_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--no-results-doc"])
    assert e.value.code == 2 and message in capsys.readouterr().err
