"""GPT-2 (GPT2LMHeadModel, GPT2Model) <-> our GPT: config mapping and tensor rules."""

from __future__ import annotations

from attention_jax.convert.hf_rules import (Family, Rule, activation_from_hf, activation_to_hf,
                                            copy, layernorm, require)
from attention_jax.models import gpt


class GPT2Family(Family):
    model_type = "gpt2"
    prefix = "transformer."
    untied = "tie_word_embeddings false in config.json gives the head weights of its own"
    architectures = ("GPT2LMHeadModel", "GPT2Model")
    base_architecture = "GPT2Model"
    head_paths = ("lm_head/",)
    config_cls = gpt.GPTConfig

    def guess_architecture(self, tensors):
        return "GPT2LMHeadModel" if any(k.startswith(self.prefix) or k == "lm_head.weight"
                                        for k in tensors) else "GPT2Model"

    def config(self, hf_cfg, arch):
        require(hf_cfg, "add_cross_attention", False, "a decoder-only model")
        require(hf_cfg, "scale_attn_weights", True, "attention is always scaled by 1/sqrt(H)")
        require(hf_cfg, "scale_attn_by_inverse_layer_idx", False, "no per-layer attention scaling")
        # GPT2Model has no LM head: our logits are then h·wteᵀ, the tied head.
        tie = arch == "GPT2Model" or bool(hf_cfg.get("tie_word_embeddings", True))
        return gpt.GPTConfig(
            # (a key config.json lacks takes GPT2Config's default, as transformers reads it)
            vocab_size=hf_cfg.get("vocab_size", 50257), max_len=hf_cfg.get("n_positions", 1024),
            num_layers=hf_cfg.get("n_layer", 12), d_model=hf_cfg.get("n_embd", 768),
            num_heads=hf_cfg.get("n_head", 12),
            mlp_dim=hf_cfg.get("n_inner"),
            activation=activation_from_hf(hf_cfg, "activation_function", "gelu_new"),
            norm_epsilon=hf_cfg.get("layer_norm_epsilon", 1e-5), tie_embeddings=tie,
            dropout_rate=hf_cfg.get("resid_pdrop", 0.1))

    def rules(self, c: gpt.GPTConfig, arch):
        d, f, v = c.d_model, c.mlp_dim or 4 * c.d_model, c.vocab_size
        rules = [copy("token_embedding/embedding", "wte.weight", (v, d)),
                 copy("position_embedding/embedding", "wpe.weight", (c.max_len, d))]
        for i in range(c.num_layers):
            o, p = f"decoder/layer_{i}/", f"h.{i}."
            # GPT-2's Conv1D stores [in, out]; c_attn's 3D outputs are q | k | v, each
            # head-major, so a reshape gives our [D, 3, N, H] without moving numbers.
            rules += [*layernorm(o + "self_attention_norm", p + "ln_1", d),
                      copy(o + "self_attention/qkv", p + "attn.c_attn.weight", (d, 3 * d)),
                      copy(o + "self_attention/qkv_bias", p + "attn.c_attn.bias", (3 * d,)),
                      copy(o + "self_attention/out", p + "attn.c_proj.weight", (d, d)),
                      copy(o + "self_attention/out_bias", p + "attn.c_proj.bias", (d,)),
                      *layernorm(o + "mlp_norm", p + "ln_2", d),
                      copy(o + "mlp/wi/kernel", p + "mlp.c_fc.weight", (d, f)),
                      copy(o + "mlp/wi/bias", p + "mlp.c_fc.bias", (f,)),
                      copy(o + "mlp/wo/kernel", p + "mlp.c_proj.weight", (f, d)),
                      copy(o + "mlp/wo/bias", p + "mlp.c_proj.bias", (d,))]
        rules += layernorm("final_norm", "ln_f", d)
        if not c.tie_embeddings:
            rules.append(Rule("lm_head/kernel", ("lm_head.weight",), ((v, d),), "linear", base=False))
        return rules

    def aliases(self, c, arch):
        return {"lm_head.weight": "wte.weight"} if c.tie_embeddings else {}

    def model(self, c, arch):
        return gpt.GPT(c)

    def arch_fields(self, c: gpt.GPTConfig):
        return dict(vocab_size=c.vocab_size, max_len=c.max_len, num_layers=c.num_layers,
                    d_model=c.d_model, num_heads=c.num_heads,
                    num_kv_heads=c.num_kv_heads or c.num_heads, mlp=c.mlp,
                    mlp_dim=c.mlp_dim or 4 * c.d_model, activation=c.activation, norm=c.norm,
                    norm_epsilon=c.norm_epsilon, position=c.position,
                    tie_embeddings=c.tie_embeddings, use_bias=c.use_bias)

    def hf_config(self, c: gpt.GPTConfig, arch):
        unsupported = {"position": ("learned", c.position), "norm": ("layernorm", c.norm),
                       "mlp": ("mlp", c.mlp), "use_bias": (True, c.use_bias),
                       "num_kv_heads": (c.num_heads, c.num_kv_heads or c.num_heads),
                       "norm_position": ("pre", c.norm_position),
                       "attention_scale": (None, c.attention_scale)}
        for field, (want, got) in unsupported.items():
            if want != got:
                raise ValueError(f"GPTConfig.{field}={got!r} has no GPT-2 equivalent; valid: {want!r}")
        activation = activation_to_hf(c.activation, "GPTConfig.activation", "GPT-2")
        return {"model_type": "gpt2", "architectures": [arch], "vocab_size": c.vocab_size,
                "n_positions": c.max_len, "n_embd": c.d_model, "n_layer": c.num_layers,
                "n_head": c.num_heads, "n_inner": c.mlp_dim, "activation_function": activation,
                "layer_norm_epsilon": c.norm_epsilon, "tie_word_embeddings": c.tie_embeddings,
                "resid_pdrop": c.dropout_rate, "embd_pdrop": c.dropout_rate, "attn_pdrop": 0.0,
                "bos_token_id": None, "eos_token_id": None}
