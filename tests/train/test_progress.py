"""The training progress bar of ``rlm fit``: steps against max_steps, also after a resume."""

from __future__ import annotations

from cli_helpers import fit_args


def _last_bar(text: str) -> str:
    """The training bar's last state in what tqdm printed (states are separated by carriage returns)."""
    return [s for s in text.replace("\n", "\r").split("\r") if s.startswith("Epoch")][-1]


def test_the_bar_counts_steps_to_max_steps_and_a_resume_starts_at_its_step(tmp_path, rlm_cache, rlm_main):
    args = [*fit_args(), "--trainer.enable_progress_bar=true"]
    first = rlm_main([*args, "--trainer.max_steps=2"], tmp_path, rlm_cache)
    assert first.returncode == 0, first.stderr[-3000:]
    assert _last_bar(first.stdout).startswith("Epoch 0, step: 100%") and "| 2/2 [" in _last_bar(first.stdout)
    # Lightning's bar read `Epoch 1/-2 ... 4/2` here: max_epochs - 1 with max_epochs -1, and the batch index
    # past the epoch's two batches of the tiny corpus.
    resumed = rlm_main([*args, "--trainer.max_steps=4", "--ckpt_path=last"], tmp_path, rlm_cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    bar = _last_bar(resumed.stdout)
    assert bar.startswith("Epoch 1, step: 100%") and "| 4/4 [" in bar and "step/s" in bar, bar
    assert "/-" not in resumed.stdout
