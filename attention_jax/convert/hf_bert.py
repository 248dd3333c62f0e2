"""BERT (BertModel, BertForMaskedLM, BertForPreTraining, BertForSequenceClassification)
<-> our Bert: config mapping and tensor rules."""

from __future__ import annotations

from attention_jax.convert.hf_rules import (Family, activation_from_hf, activation_to_hf,
                                            attention, copy, layernorm, linear, num_labels,
                                            require)
from attention_jax.models import bert


class BertFamily(Family):
    model_type = "bert"
    prefix = "bert."
    architectures = ("BertModel", "BertForMaskedLM", "BertForPreTraining",
                     "BertForSequenceClassification")
    base_architecture = "BertModel"
    head_paths = ("pooler/", "nsp/", "classifier/", "mlm_transform/", "mlm_norm/", "mlm_bias")
    config_cls = bert.BertConfig
    HEADS = {"BertModel": "encoder", "BertForMaskedLM": "pretraining",
             "BertForPreTraining": "pretraining", "BertForSequenceClassification": "classification"}

    def guess_architecture(self, tensors):
        if "cls.seq_relationship.weight" in tensors:
            return "BertForPreTraining"
        if "cls.predictions.bias" in tensors:
            return "BertForMaskedLM"
        return "BertForSequenceClassification" if "classifier.weight" in tensors else "BertModel"

    def config(self, hf_cfg, arch):
        require(hf_cfg, "position_embedding_type", "absolute", "learned absolute positions")
        require(hf_cfg, "is_decoder", False, "a bidirectional encoder")
        require(hf_cfg, "add_cross_attention", False, "an encoder without cross-attention")
        if arch in ("BertForMaskedLM", "BertForPreTraining"):
            require(hf_cfg, "tie_word_embeddings", True, "the MLM output matrix is the word embedding")
        return bert.BertConfig(
            # (a key config.json lacks takes BertConfig's default, as transformers reads it)
            vocab_size=hf_cfg.get("vocab_size", 30522), d_model=hf_cfg.get("hidden_size", 768),
            num_layers=hf_cfg.get("num_hidden_layers", 12),
            num_heads=hf_cfg.get("num_attention_heads", 12),
            mlp_dim=hf_cfg.get("intermediate_size", 3072),
            max_len=hf_cfg.get("max_position_embeddings", 512),
            type_vocab_size=hf_cfg.get("type_vocab_size", 2), num_labels=num_labels(hf_cfg),
            activation=activation_from_hf(hf_cfg, "hidden_act", "gelu"),
            norm_epsilon=hf_cfg.get("layer_norm_eps", 1e-12),
            dropout_rate=hf_cfg.get("hidden_dropout_prob", 0.1),
            attention_dropout_rate=hf_cfg.get("attention_probs_dropout_prob", 0.1),
            initializer_range=hf_cfg.get("initializer_range", 0.02))

    def rules(self, c: bert.BertConfig, arch):
        d, f, v = c.d_model, c.mlp_dim, c.vocab_size
        e = "embeddings."
        rules = [copy("word_embeddings/embedding", e + "word_embeddings.weight", (v, d)),
                 copy("position_embeddings/embedding", e + "position_embeddings.weight",
                      (c.max_len, d)),
                 copy("token_type_embeddings/embedding", e + "token_type_embeddings.weight",
                      (c.type_vocab_size, d)),
                 *layernorm("embeddings_norm", e + "LayerNorm", d)]
        for i in range(c.num_layers):
            o, p = f"encoder/layer_{i}/", f"encoder.layer.{i}."
            a = p + "attention."
            # Post-norm: attention.output.LayerNorm follows the residual add of the
            # attention sublayer, output.LayerNorm that of the feed-forward.
            rules += [*attention(o + "self_attention", a + "self.query", a + "self.key",
                                 a + "self.value", a + "output.dense", d),
                      *layernorm(o + "self_attention_norm", a + "output.LayerNorm", d),
                      *linear(o + "mlp/wi", p + "intermediate.dense", d, f),
                      *linear(o + "mlp/wo", p + "output.dense", f, d),
                      *layernorm(o + "mlp_norm", p + "output.LayerNorm", d)]
        if arch != "BertForMaskedLM":  # transformers builds BertForMaskedLM without a pooler
            # BertModel(add_pooling_layer=False) saves none either.
            rules += linear("pooler", "pooler.dense", d, d, optional=arch == "BertModel")
        if arch in ("BertForMaskedLM", "BertForPreTraining"):
            t = "cls.predictions."
            rules += [*linear("mlm_transform", t + "transform.dense", d, d, base=False),
                      *layernorm("mlm_norm", t + "transform.LayerNorm", d, base=False),
                      copy("mlm_bias", t + "bias", (v,), base=False)]
        if arch == "BertForPreTraining":
            rules += linear("nsp", "cls.seq_relationship", d, 2, base=False)
        if arch == "BertForSequenceClassification":
            rules += linear("classifier", "classifier", d, c.num_labels, base=False)
        return rules

    def aliases(self, c, arch):
        return {"cls.predictions.decoder.weight": "embeddings.word_embeddings.weight",
                "cls.predictions.decoder.bias": "cls.predictions.bias"}

    def model(self, c, arch):
        return bert.Bert(c, head=self.HEADS[arch])

    def arch_fields(self, c: bert.BertConfig):
        return dict(vocab_size=c.vocab_size, d_model=c.d_model, num_layers=c.num_layers,
                    num_heads=c.num_heads, mlp_dim=c.mlp_dim, max_len=c.max_len,
                    type_vocab_size=c.type_vocab_size, activation=c.activation,
                    norm_epsilon=c.norm_epsilon,
                    position_embeddings=c.position_embeddings)

    def hf_config(self, c: bert.BertConfig, arch):
        if not c.position_embeddings:
            raise ValueError("BertConfig.position_embeddings=False has no BERT equivalent; valid: True")
        out = {"model_type": "bert", "architectures": [arch], "vocab_size": c.vocab_size,
               "hidden_size": c.d_model, "num_hidden_layers": c.num_layers,
               "num_attention_heads": c.num_heads, "intermediate_size": c.mlp_dim,
               "hidden_act": activation_to_hf(c.activation, "BertConfig.activation", "BERT"),
               "hidden_dropout_prob": c.dropout_rate,
               "attention_probs_dropout_prob": c.attention_dropout_rate,
               "max_position_embeddings": c.max_len, "type_vocab_size": c.type_vocab_size,
               "initializer_range": c.initializer_range, "layer_norm_eps": c.norm_epsilon,
               "position_embedding_type": "absolute", "pad_token_id": 0,
               "tie_word_embeddings": True}
        if arch == "BertForSequenceClassification":
            out["id2label"] = {str(i): f"LABEL_{i}" for i in range(c.num_labels)}
            out["label2id"] = {f"LABEL_{i}": i for i in range(c.num_labels)}
        return out
