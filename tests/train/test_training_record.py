"""train/report.py: the drafter's TRAINING.md is written from the trainer's summary.json and the data pass's
data_stats.json; every figure in it is one of theirs, formatted as stated, and the evaluation command it prints
parses with the real ``bench`` parser."""
from __future__ import annotations

import json
import shlex

from mindspore_eagle.train import report

SUMMARY = {
    "drafter": {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                "intermediate_size": 1536, "rope_theta": 100000.0,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}},
    "heldout": {"samples": 32, "masked_tokens_step0": 5000, "acc": [0.61234, 0.4],
                "cov": {"k4": [0.9, 0.7]}, "L_implied": {"D3": {"k1": 1.834, "k4": 2.341}}},
    "max_len": 512, "samples_train": 2016, "train_tokens": 891703, "samples_eval": 32, "vd": 8192,
    "vocab_mass_data": 0.98765, "vocab_mass_teacher_argmax": 0.99123, "ttt_length": 7, "steps": 600,
    "batch_size": 4, "pack_len": 512, "lr": 6e-05, "warmup": 30, "schedule": "cosine", "steps_per_s": 0.25,
    "tokens_per_s": 512.0, "wall_seconds_this_run": 2400, "train_acc_last100": [0.7, 0.5], "train_loss_last100": 1.2345,
    "command": "python -m mindspore_eagle.train --stage train --steps 600",
}
DATA = {"read": 9000, "excluded_eval": 12, "too_few_assistant": 40, "template_mismatch": 0, "tokenize_mismatch": 3,
        "regenerated": 8210}


def test_training_md_carries_the_summary_figures():
    md = report.training_md(SUMMARY, DATA, "Drafter X", extra="note", drafter_ref="mindspore_eagle/assets/d")
    lines = md.splitlines()
    assert lines[0] == "# Drafter X"
    assert "- Conversations read: 9000; excluded because the first user turn matches an MT-Bench or HumanEval " \
           "prompt (normalised text): **12**;" in md.replace("\n", " ")
    assert "aux layers (inputs of teacher layers) [2, 15, 27]" in md          # ids + 1
    assert "Draft vocabulary Vd = 8192: covers 0.9877 of the loss-masked data tokens and 0.9912" in md
    assert "600 optimiser steps of 4 rows of 512 tokens packed with whole samples (each truncated to 512)" in md
    assert "lr 6e-05 with 30 warmup steps then cosine" in md
    assert "per TTT step: s0: 0.612, s1: 0.400." in md
    assert "- Held-out top-4 coverage of the teacher argmax, per TTT step: s0: 0.900, s1: 0.700." in md
    assert "Implied mean accepted length at depth 3 (coverage.py): chain 1.83; top-4 tree 2.34." in md
    assert "Wall time: 2400 s (training process)." in md and lines[-2:] == ["## Notes", "note"]
    assert "to be filled" not in md


def test_the_evaluation_command_parses():
    from mindspore_eagle import bench

    md = report.training_md(SUMMARY, DATA, "D", drafter_ref="runs/drafter")
    cmd = next(line for line in md.splitlines() if line.startswith("mindspore-eagle bench "))
    argv = shlex.split(cmd)[2:]
    args = bench.build_parser().parse_args(argv)
    assert args.turns == 240 and "model.drafter=runs/drafter" in args.set


def test_padded_batches_and_main_writes_the_file(tmp_path):
    s = {**SUMMARY, "pack_len": 0, "batch_size": 1, "heldout": {}}
    md = report.training_md(s, DATA, "D")
    assert "of 1 sequence (512 tokens, padded)" in md and "coverage" not in md
    d, f = tmp_path / "drafter", tmp_path / "features"
    d.mkdir(), f.mkdir()
    (d / "summary.json").write_text(json.dumps(SUMMARY))
    (f / "data_stats.json").write_text(json.dumps(DATA))
    assert report.main([str(d), str(f), "--title", "T"]) == 0
    assert (d / "TRAINING.md").read_text() == report.training_md(SUMMARY, DATA, "T", drafter_ref=str(d))
