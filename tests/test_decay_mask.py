"""optimizer.decay_mask by role: for each model family, exactly which parameters decay.

Matrices decay (projection kernels of any rank, ViT's patch-embedding convolution, MoE
routers and experts); biases, norm scales, lookup tables (token, segment, position) and
ViT's [CLS] token do not. Layer indices are written layer_N.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from attention_jax import train
from attention_jax.models import bert, encdec, gpt, rnn, vit
from attention_jax import optimizer

TOKENS = jnp.zeros((1, 8), jnp.int32)
BLOCK = {"mlp/wi/kernel", "mlp/wo/kernel", "self_attention/qkv", "self_attention/out"}


def _layer(prefix, names):
    return {f"{prefix}/layer_N/{n}" for n in names}


FAMILIES = {
    "gpt": (lambda: gpt.GPT(gpt.GPTConfig.from_variant("gpt-tiny")), (TOKENS,),
            _layer("decoder", BLOCK)),
    "gpt-moe-untied": (lambda: gpt.GPT(gpt.GPTConfig.from_variant(
        "gpt-tiny", mlp="moe", tie_embeddings=False, position="rope", norm="rmsnorm")), (TOKENS,),
        _layer("decoder", {"mlp/router", "mlp/wi", "mlp/wo", "self_attention/qkv",
                           "self_attention/out"}) | {"lm_head/kernel"}),
    "bert": (lambda: bert.Bert(bert.BertConfig.from_variant("bert-tiny")), (TOKENS,),
             _layer("encoder", BLOCK) | {"mlm_transform/kernel", "nsp/kernel", "pooler/kernel"}),
    "vit": (lambda: vit.ViT(vit.ViTConfig.from_variant("vit-tiny/2")), (jnp.zeros((1, 8, 8, 1)),),
            _layer("encoder", BLOCK) | {"patch_embedding", "head/kernel"}),
    "encdec": (lambda: encdec.EncoderDecoder(encdec.get_config("transformer-tiny")),
               (TOKENS, TOKENS),
               _layer("encoder", BLOCK) | _layer("decoder", BLOCK | {
                   "cross_attention/query", "cross_attention/kv", "cross_attention/out"})),
    "rnn": (lambda: rnn.RNNSeq2Seq(rnn.RNNConfig.from_variant("tiny")), (TOKENS, TOKENS),
            {"attn_keys/kernel", "init_state/kernel", "decoder/attn_query/kernel",
             "decoder/attn_v/kernel", "decoder/logits/kernel", "decoder/readout/kernel"}
            | {f"{rnn_}/cell/{g}/kernel" for rnn_ in ("encoder/forward_rnn",
                                                      "encoder/backward_rnn", "decoder")
               for g in ("ir", "iz", "in", "hr", "hz", "hn")}),
}


def _decayed(model, args):
    params = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), *args)["params"]))
    mask = optimizer.decay_mask(params)
    names = set()
    for path, decays in jax.tree_util.tree_flatten_with_path(mask)[0]:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        assert isinstance(decays, bool), name
        if decays:
            names.add(re.sub(r"layer_\d+", "layer_N", name))
    return names, params


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_matrices_decay_and_nothing_else(family):
    build, args, want = FAMILIES[family]
    got, params = _decayed(build(), args)
    assert got == want, (f"decay but should not: {sorted(got - want)}; "
                         f"should decay but do not: {sorted(want - got)}")
    # What is left out is a table, a norm scale, a bias or the [CLS] token.
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        leaf_name = str(getattr(path[-1], "key", path[-1]))
        full = re.sub(r"layer_\d+", "layer_N", "/".join(str(getattr(k, "key", k)) for k in path))
        if full not in want:
            assert leaf_name in optimizer.NO_DECAY or leaf_name.endswith("_bias"), full


def test_vit_patch_embedding_decays_and_cls_token_does_not():
    """The bug a substring rule had: "embed" in the name spared the patch projection's
    kernel from decay, while the [1, D] cls token (2-D) was decayed."""
    build, args, _ = FAMILIES["vit"]
    got, _ = _decayed(build(), args)
    assert "patch_embedding" in got and "cls" not in got and "position_embeddings" not in got


def test_stacked_layers_keep_their_roles():
    """scan_layers stacks every per-layer leaf: a bias becomes [L, D] but stays undecayed."""
    model = gpt.GPT(gpt.GPTConfig.from_variant("gpt-tiny", scan_layers=True))
    got, _ = _decayed(model, (TOKENS,))
    assert got and all(n.rsplit("/", 1)[-1] not in ("bias", "scale") for n in got)
    assert not any(n.endswith("_bias") for n in got)
