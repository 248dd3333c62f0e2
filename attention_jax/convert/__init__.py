"""Checkpoints from other ecosystems: Hugging Face GPT-2, BERT and ViT.

    from attention_jax import convert
    ckpt = convert.load_hf("path/to/hf_dir")      # our model + params (no torch needed)
    out, aux = ckpt.model.apply({"params": ckpt.params}, inputs)
    convert.export_hf(model, params, "out_dir")   # GPT-2 / BERT / ViT back to transformers
    params = convert.init_params_from_hf("path/to/hf_dir", model)   # fine-tuning start

    enc = convert.load_sentence_encoder()          # bundled all-MiniLM-L6-v2
    enc.similarity(["A cat sits on the mat."], ["A kitten rests on a rug.", "Stocks fell."])

CLI: `--config.train.init_from=hf:<dir>` warm-starts an experiment from a HF checkpoint
(`restore_params_from_hf`, called by train.restore_or_init), and `--mode=embed`
prints sentence embeddings (main.embed_texts). See hf.py and embed.py.
"""

from attention_jax.convert.embed import (SentenceEncoder, bundled_minilm_dir,
                                         load_sentence_encoder, mean_pool)
from attention_jax.convert.hf import (ConversionError, HFCheckpoint, config_from_hf, export_hf,
                                      hf_model_overrides, init_params_from_hf, load_hf,
                                      read_hf_dir, restore_params_from_hf)

__all__ = ["ConversionError", "HFCheckpoint", "SentenceEncoder", "bundled_minilm_dir",
           "config_from_hf", "export_hf", "hf_model_overrides",
           "init_params_from_hf", "load_hf", "load_sentence_encoder", "mean_pool",
           "read_hf_dir", "restore_params_from_hf"]
