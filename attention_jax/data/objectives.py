"""Training objectives as numpy transforms on examples: MLM masking, NSP pairs,
next-token and teacher-forcing targets, image normalisation and augmentation.

They run on the host inside the grain pipeline (`Loader(transform=...)`), take an
explicit `np.random.Generator` (the loader seeds it by (seed, global index), which keeps
resumption exact) and return dicts of numpy arrays with fixed shapes so that jit
compiles once.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from attention_jax.errors import is_int

# --------------------------------------------------------------------------------------
# Language modelling.
# --------------------------------------------------------------------------------------


PACKINGS = ('documents', 'stream')


def next_token_targets(row: dict[str, np.ndarray],
                       packing: str = 'documents') -> dict[str, np.ndarray]:
    """Causal LM example from a packed row [L]: predict token t+1 at t.

    packing 'documents': each document is its own sequence. The last token of every
      piece has no target in the row (the next token belongs to another document or is
      padding), so its weight is 0; segment_ids and positions go with the example, for
      attention that stays inside a document and positions that restart at each.
    packing 'stream': the row is a window of one token stream, as GPT-2 and nanoGPT
      train. Every next token in the row is a target (a document's end-of-text token
      predicts the next document's first token), except padding; the row's last token
      has none, its next being the next row's first (one pair in L of the stream, the
      same ones each epoch: the rows are fixed windows, where nanoGPT reads L + 1
      tokens at a random offset). No segment_ids or positions, so attention is plain
      causal over the row and positions run 0..L-1.
    """
    if packing not in PACKINGS:
        raise ValueError(f'packing={packing!r} is unknown; valid: {PACKINGS}')
    tokens, seg = row['tokens'], row['segment_ids']
    targets = np.zeros_like(tokens)
    targets[..., :-1] = tokens[..., 1:]
    weights = np.zeros(tokens.shape, np.float32)
    real = seg != 0
    if packing == 'stream':
        weights[..., :-1] = real[..., 1:] & real[..., :-1]
        return {'inputs': tokens, 'targets': targets, 'weights': weights}
    weights[..., :-1] = (seg[..., 1:] == seg[..., :-1]) & real[..., :-1]
    return {'inputs': tokens, 'targets': targets, 'weights': weights,
            'segment_ids': seg, 'positions': row['positions']}


@functools.lru_cache(maxsize=16)
def _normal_ids(vocab_size: int, specials: tuple[int, ...]) -> np.ndarray:
    """The ids a random replacement may take (all but the special ones). Cached: over a
    30k WordPiece vocabulary, setdiff1d per row was ~90% of the masking time."""
    ids = np.setdiff1d(np.arange(vocab_size), specials)
    ids.flags.writeable = False
    return ids


def mlm_mask(tokens: np.ndarray, rng: np.random.Generator, *, mask_id: int, vocab_size: int,
             special_ids: Collection[int], mask_rate: float = 0.15,
             mask_token_rate: float = 0.8, random_token_rate: float = 0.1) -> dict[str, np.ndarray]:
    """BERT masking (Devlin et al. 2019, sec. 3.1) of tokens [..., L].

    In each row, round(mask_rate * eligible) positions (at least 1) are chosen among
    non-special tokens (padding, [CLS], [SEP], ... are never chosen). Of those, 80% become [MASK],
    10% a random non-special token, 10% stay, and all of them are predicted.
    Returns inputs, targets (the original tokens) and weights (1 where predicted).
    """
    # Fractions, not percentages: mask_rate=15 chose every ordinary token and
    # mask_token_rate=80 made every chosen one [MASK], a negative rate chose none, unsaid.
    for name, rate in (('mask_rate', mask_rate), ('mask_token_rate', mask_token_rate),
                       ('random_token_rate', random_token_rate)):
        if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0 <= rate <= 1:
            raise ValueError(f'{name}={rate!r} is out of range; valid: a fraction in [0, 1] '
                             f'(0.15, not 15)')
    if mask_token_rate + random_token_rate > 1:
        raise ValueError(f'mask_token_rate={mask_token_rate} + random_token_rate='
                         f'{random_token_rate} > 1; valid: fractions of the chosen tokens '
                         f'summing to at most 1 (the rest keep their token)')
    if not is_int(mask_id) or not 0 <= mask_id < vocab_size:  # past the embedding table
        raise ValueError(f'mask_id={mask_id!r} is not a token id of the vocabulary; valid: an '
                         f'int in 0..{vocab_size - 1} (vocab_size={vocab_size})')
    tokens = np.asarray(tokens)
    specials = np.array(sorted(special_ids), dtype=tokens.dtype)
    eligible = ~np.isin(tokens, specials)
    # Choose exactly k positions per row: rank random keys, ineligible ones last.
    keys = np.where(eligible, rng.random(tokens.shape), np.inf)
    ranks = np.argsort(np.argsort(keys, axis=-1), axis=-1)
    count = eligible.sum(-1, keepdims=True)
    # At least one where a row has an ordinary token (as BERT's own data script does): a
    # short row (3 tokens or fewer at 15%) otherwise rounded to nothing to predict.
    k = np.round(mask_rate * count)
    k = np.where((count > 0) & (mask_rate > 0), np.maximum(k, 1), k)
    chosen = (ranks < k) & eligible

    action = rng.random(tokens.shape)
    to_mask = chosen & (action < mask_token_rate)
    to_random = (chosen & (action >= mask_token_rate)
                 & (action < mask_token_rate + random_token_rate))
    normal_ids = _normal_ids(int(vocab_size), tuple(int(i) for i in specials))
    random_ids = normal_ids[rng.integers(0, len(normal_ids), tokens.shape)]
    inputs = np.where(to_mask, mask_id, np.where(to_random, random_ids, tokens))
    return {'inputs': inputs.astype(tokens.dtype), 'targets': tokens,
            'weights': chosen.astype(np.float32)}


def nsp_pairs(documents: Sequence[Sequence[Sequence[int]]], rng: np.random.Generator, *,
              seq_len: int, cls_id: int, sep_id: int, pad_id: int = 0) -> list[dict]:
    """Next-sentence-prediction examples (Devlin et al. 2019, sec. 3.1, task #2).

    For every pair of consecutive segments (A, B) of a document, with probability 1/2
    B is kept (is_next=1), otherwise replaced by a random segment of another document
    (is_next=0). Each example is [CLS] A [SEP] B [SEP] padded to `seq_len`, with
    type_ids 0 for A and 1 for B; the longer side is trimmed when it does not fit.
    `next_sentence_label` is the NSP head's class (models/bert.py: logits IsNext /
    NotNext, Google's and Hugging Face's order): 0 where B follows A, 1 where it is
    random, the complement of `is_next`. Train the head on it: on `is_next` its two
    classes swap, and an exported (or imported) NSP head reads the other way round.
    """
    if seq_len < 3:  # (trimming A and B to fit popped from an empty list: an IndexError)
        raise ValueError(f'nsp_pairs: seq_len={seq_len} cannot hold [CLS] A [SEP] B [SEP]; '
                         f'valid: seq_len >= 3 (the three special tokens; A and B are trimmed '
                         f'to fit the rest)')
    # A random segment comes from a document with segments (an empty one was
    # rng.integers(0, 0): "high <= 0", for some seeds).
    with_segments = [d for d, doc in enumerate(documents) if len(doc)]
    place = {d: k for k, d in enumerate(with_segments)}
    if len(with_segments) < 2:
        raise ValueError('nsp_pairs needs at least two documents with segments to draw '
                         f'random segments; got {len(with_segments)} of {len(documents)}')
    examples = []
    for d, doc in enumerate(documents):
        for i in range(len(doc) - 1):
            a, b, is_next = list(doc[i]), list(doc[i + 1]), 1
            if rng.random() < 0.5:
                k = int(rng.integers(0, len(with_segments) - 1))
                k += k >= place[d]  # any document but this one (which has segments)
                segs = documents[with_segments[k]]
                b, is_next = list(segs[int(rng.integers(0, len(segs)))]), 0
            while len(a) + len(b) > seq_len - 3:
                (a if len(a) > len(b) else b).pop()
            tokens = [cls_id, *a, sep_id, *b, sep_id]
            type_ids = [0] * (len(a) + 2) + [1] * (len(b) + 1)
            pad = seq_len - len(tokens)
            examples.append({'tokens': np.array(tokens + [pad_id] * pad, np.int32),
                             'type_ids': np.array(type_ids + [0] * pad, np.int32),
                             'is_next': np.int32(is_next),
                             'next_sentence_label': np.int32(1 - is_next)})
    return examples


# --------------------------------------------------------------------------------------
# Sequence to sequence.
# --------------------------------------------------------------------------------------


def shift_right(targets, bos_id: int = 1):
    """Teacher forcing: the decoder reads [BOS, y_1, ..., y_{n-1}] and predicts y_1..y_n.

    targets [..., T]: numpy in the data pipeline, a jax array inside a model's step (the
    result is of the same kind)."""
    xp = jnp if isinstance(targets, jax.Array) else np
    targets = xp.asarray(targets)
    bos = xp.full_like(targets[..., :1], bos_id)
    return xp.concatenate([bos, targets[..., :-1]], axis=-1)


def _pad_to(ids: Sequence[int], length: int, pad_id: int, name: str) -> np.ndarray:
    if len(ids) > length:
        raise ValueError(f'{name} has {len(ids)} tokens, more than the {length} allowed; '
                         f'raise the max length or filter long examples')
    return np.array(list(ids) + [pad_id] * (length - len(ids)), np.int32)


def seq2seq_example(source_ids: Sequence[int], target_ids: Sequence[int], *,
                    source_len: int, target_len: int, bos_id: int, eos_id: int,
                    pad_id: int = 0) -> dict[str, np.ndarray]:
    """Fixed-length encoder-decoder example. Targets end with EOS so decoding can stop;
    `target_weights` zero the padding in the loss: by position, the target's tokens and
    its EOS weighing 1 (not by id: a tokenizer whose pad token is its end-of-text token,
    as a file saved with pad_token = eos_token names it, weighed every EOS 0, and the
    model never learnt to stop)."""
    targets = _pad_to([*target_ids, eos_id], target_len, pad_id, 'target')
    return {'inputs': _pad_to(source_ids, source_len, pad_id, 'source'),
            'decoder_inputs': shift_right(targets, bos_id),
            'targets': targets,
            'target_weights': (np.arange(target_len) <= len(target_ids)).astype(np.float32)}


# --------------------------------------------------------------------------------------
# Text classification.
# --------------------------------------------------------------------------------------


def least_classified_len(pair: bool) -> int:
    """The shortest seq_len that holds a text (one token of each, for a pair) between its
    special tokens."""
    return 5 if pair else 3


def classification_example(first: Sequence[int], second: Sequence[int] | None = None, *,
                           seq_len: int, start_id: int, end_id: int,
                           pad_id: int = 0) -> dict[str, np.ndarray]:
    """BERT's input for a sentence-level task (Devlin et al. 2019, §3.2 and §4): [CLS] A
    [SEP], or [CLS] A [SEP] B [SEP] for a pair, padded to seq_len; `token_types` 0 on A's
    part and 1 on B's, `mask` 1 on real tokens. What does not fit is cut from the texts'
    ends, as transformers' tokenizers cut a pair ('longest_first', so that an exported
    model reads what the run read): the shorter text (A on a tie) keeps up to half the
    room, the other the rest."""
    a, b = list(first), None if second is None else list(second)
    room = seq_len - (2 if b is None else 3)  # the special tokens
    if room < (1 if b is None else 2):
        raise ValueError(f'seq_len={seq_len} leaves no room for the text between the special '
                         f'tokens; valid: seq_len >= {least_classified_len(b is not None)}')
    if b is None:
        a = a[:room]
    elif len(a) + len(b) > room:
        if len(a) > len(b):
            keep_b = min(len(b), room // 2)
            a, b = a[:room - keep_b], b[:keep_b]
        else:
            keep_a = min(len(a), room // 2)
            a, b = a[:keep_a], b[:room - keep_a]
    ids = [start_id, *a, end_id] + ([] if b is None else [*b, end_id])
    types = [0] * (len(a) + 2) + [1] * (len(ids) - len(a) - 2)
    n = len(ids)
    return {'inputs': np.array(ids + [pad_id] * (seq_len - n), np.int32),
            'token_types': np.array(types + [0] * (seq_len - n), np.int32),
            'mask': (np.arange(seq_len) < n).astype(np.int32)}


# --------------------------------------------------------------------------------------
# Images.
# --------------------------------------------------------------------------------------


def normalize_image(image: np.ndarray, mean: Sequence[float] | float = 0.5,
                    std: Sequence[float] | float = 0.5) -> np.ndarray:
    """uint8 [..., H, W, C] -> float32 (x/255 - mean) / std, per channel."""
    x = np.asarray(image, np.float32) / 255.0
    return (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)


def random_crop_flip(image: np.ndarray, rng: np.random.Generator, *, padding: int = 0,
                     flip: bool = False) -> np.ndarray:
    """Pad by `padding` zeros on each side, crop back to H x W at a random offset, and
    (if `flip`) mirror left-right with probability 1/2 (the CIFAR recipe of He et al.
    2016). Leave flip off where mirroring changes the class (digits, text)."""
    h, w = image.shape[:2]
    if padding > 0:
        widths = [(padding, padding), (padding, padding)] + [(0, 0)] * (image.ndim - 2)
        padded = np.pad(image, widths)
        top, left = rng.integers(0, 2 * padding + 1, size=2)
        image = padded[top:top + h, left:left + w]
    if flip and rng.random() < 0.5:
        image = image[:, ::-1]
    return np.ascontiguousarray(image)


def mix_batch(images, labels, rng, *, num_classes: int, mixup: float = 0.0,
              cutmix: float = 0.0):
    """Mixup (Zhang et al. 2018) or CutMix (Yun et al. 2019) of a batch with its reverse.

    images [B, H, W, C] float, labels [B] int -> (images, soft targets [B, num_classes]).
    Each image i is mixed with image B-1-i by λ ~ Beta(α, α): mixup blends the pixels,
    x = λ x_i + (1-λ) x_{B-1-i}; cutmix pastes a box of area fraction ≈ 1-λ from
    x_{B-1-i} (λ then recomputed from the box actually pasted, clipped at the border).
    The targets are λ onehot(y_i) + (1-λ) onehot(y_{B-1-i}): each row sums to 1. With both
    α > 0, each batch is mixed one way or the other with probability 1/2 (as timm's
    default). A jax function: it runs inside the jitted training step.
    """
    if mixup < 0 or cutmix < 0 or not (mixup or cutmix):
        raise ValueError(f'mixup={mixup}, cutmix={cutmix}: each >= 0 and at least one > 0')
    images = jnp.asarray(images)
    b, h, w = images.shape[:3]
    r_choice, r_mix, r_cut, r_y, r_x = jax.random.split(rng, 5)
    other = images[::-1]
    onehot = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)
    outs = []
    if mixup:
        lam = jax.random.beta(r_mix, mixup, mixup)
        outs.append((lam * images + (1 - lam) * other, lam))
    if cutmix:
        lam = jax.random.beta(r_cut, cutmix, cutmix)
        cut = jnp.sqrt(1.0 - lam)  # box sides: area fraction 1-λ before clipping
        cy, cx = jax.random.uniform(r_y) * h, jax.random.uniform(r_x) * w
        y0, y1 = jnp.clip(cy - cut * h / 2, 0, h).astype(jnp.int32), jnp.clip(cy + cut * h / 2, 0, h).astype(jnp.int32)
        x0, x1 = jnp.clip(cx - cut * w / 2, 0, w).astype(jnp.int32), jnp.clip(cx + cut * w / 2, 0, w).astype(jnp.int32)
        rows, cols = jnp.arange(h)[:, None], jnp.arange(w)[None, :]
        box = (rows >= y0) & (rows < y1) & (cols >= x0) & (cols < x1)  # [H, W]
        pasted = jnp.where(box[None, :, :, None], other, images)
        outs.append((pasted, 1.0 - box.sum() / (h * w)))
    if len(outs) == 2:
        use_cut = jax.random.bernoulli(r_choice)
        mixed = jnp.where(use_cut, outs[1][0], outs[0][0])
        lam = jnp.where(use_cut, outs[1][1], outs[0][1])
    else:
        mixed, lam = outs[0]
    lam = jnp.asarray(lam, jnp.float32)
    return mixed.astype(images.dtype), lam * onehot + (1 - lam) * onehot[::-1]
