"""The main job, ``zero-offload train``: a GPT-2 model (``model``), a text corpus turned into cached
tokens and deterministic per-rank batches (``data``, ``tokenizer``), and the training loop.

Nothing outside ``cli.py`` imports this package; the model here knows nothing of ZeRO.
"""
