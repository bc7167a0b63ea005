"""EAGLE-3 drafter training on MindSpore (docs/design.md, "Drafter training").

Pipeline (``python -m mindspore_eagle.train``, see ``__main__``):
    data.build_samples        ShareGPT -> chat-templated ids + assistant loss mask (eval prompts excluded)
    prompts.build_registry    offline prompts of the evaluation's kinds, balanced order, eval prompts excluded
    regen_run / shards        ``train regen``: the teacher's greedy replies in resumable JSONL shards (--regen-dir)
    features.extract_features teacher prefill -> resumable .npz shards (aux f16 [n,3H], hidden f16 [n,H], argmax)
    vocab.build_vocab         Vd most frequent loss-masked tokens -> d2t / t2d
    batching                  per-sample TTT shifts -> B rows x T (one sample per row, or packed), sample stream
    ttt.TTTDrafter/TrainStep  TTT unroll Cell + jitted value_and_grad / clip / AdamW step
    coverage                  held-out top-k coverage per TTT step and the mean accepted length it implies
    trainer.train             loop, checkpoints + exact resume, held-out eval log, SpecForge fp16 export, summary
    report                    TRAINING.md from summary.json and data_stats.json
"""
