"""A checkpoint's retrieval index damaged in place (same size) is caught by its checksum and rebuilt, saying so."""

from __future__ import annotations

from test_retrieval_training import fitted_with_index, make_module, trainer

from rlm.plugins._retrieval_rebuild import RebuildCallback


def test_resume_rebuilds_a_damaged_neighbour_table_with_a_log_line(tmp_path, capsys):
    data, module, ckpt = fitted_with_index(tmp_path)
    table = module.model.plugins["retrieval"].memory.path / "neighbours.npy"
    raw = bytearray(table.read_bytes())
    raw[-16:] = bytes(16)  # neighbour ids zeroed in place: the size check alone would pass
    table.write_bytes(bytes(raw))
    capsys.readouterr()
    again = make_module({"k": 2, "schedule": "never", "index_factory": "Flat"})
    t2 = trainer(tmp_path, 3)
    t2.fit(again, datamodule=data, ckpt_path=ckpt)
    assert next(c for c in t2.callbacks if isinstance(c, RebuildCallback)).history == [(2, "built")]
    err = capsys.readouterr().err
    assert "not reusing the checkpoint's index" in err and "neighbours.npy does not match its checksum" in err
