"""Tokenizers: round trips, save/load from a workdir, WordPiece equal to the
`tokenizers` library's ids."""

import ml_collections
import numpy as np
import pytest

from attention_jax import data

TEXT = 'Hello, world! Zwölf Boxkämpfer jagen Viktor — 42 × π ≈ 131.9\n\tdef f(x): return x'

SENTENCES = [
    'Hello, world! It\'s a test.',
    'Héllo Wörld — naïve café résumé',
    'The quick brown fox jumps over the lazy dog\'s back; $100 + 20% = ?',
    'def f(x): return x**2  # a comment',
    '北京欢迎你 and 東京',
    'unbelievably antidisestablishmentarianism supercalifragilisticexpialidocious',
    'a [MASK] in the middle [SEP] and more',
    'tabs\tand\nnewlines\r\n ok',
    'symbols ∑ ≤ ≥ ™ © and an emoji 😀',
    'x' * 150,
    '',
]


def _corpus():
    return [f'line {i}: the {w} jumps over {i * 7} lazy dogs; héllo wörld.'
            for i, w in enumerate(['quick fox', 'slow cat', 'brown bear', 'tiny ant'] * 25)]


def test_char_tokenizer_round_trip_and_unknown(tmp_path):
    tok = data.get_tokenizer('char', texts=[TEXT])
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT) and tok.decode(ids) == TEXT
    assert tok.pad_id == 0 and 0 not in ids
    assert tok.encode('Q') == [tok.unk_id]  # 'Q' is not in TEXT.
    assert tok.decode(tok.encode('Q' + TEXT[:3])) == '<unk>' + TEXT[:3]  # shown, not dropped
    loaded = data.load_tokenizer(tok.save(str(tmp_path / 'char')))
    assert loaded.encode(TEXT) == ids and loaded.vocab_size == tok.vocab_size


def test_byte_tokenizer_round_trip_any_text(tmp_path):
    tok = data.get_tokenizer('byte')
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT.encode('utf-8'))
    assert min(ids) >= 3 and max(ids) < tok.vocab_size == 259
    assert tok.decode(ids) == TEXT
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, 0, 0]) == TEXT  # Specials skipped.
    assert data.load_tokenizer(tok.save(str(tmp_path / 'b'))).encode(TEXT) == ids


def test_bpe_trains_round_trips_and_reloads(tmp_path):
    corpus = _corpus()
    tok = data.get_tokenizer('bpe', texts=corpus, vocab_size=400)
    assert tok.pad_id == 0 and 256 < tok.vocab_size <= 400
    for text in corpus[:5] + [TEXT]:
        assert tok.decode(tok.encode(text)) == text
    # Merges were learnt: frequent words take fewer tokens than bytes.
    assert len(tok.encode(corpus[0])) < len(corpus[0].encode()) / 2
    loaded = data.load_tokenizer(tok.save(str(tmp_path / 'bpe')))
    assert isinstance(loaded, data.BPETokenizer)
    assert loaded.encode(TEXT) == tok.encode(TEXT)
    assert loaded.special_ids == tok.special_ids


def test_wordpiece_matches_the_tokenizers_library():
    from tokenizers import Tokenizer as HFTokenizer
    tok = data.get_tokenizer('wordpiece')
    reference = HFTokenizer.from_file(tok.path)
    reference.no_padding()
    reference.no_truncation()
    for sentence in SENTENCES:
        assert tok.encode(sentence) == reference.encode(
            sentence, add_special_tokens=False).ids, sentence
        assert tok.encode(sentence, add_special_tokens=True) == reference.encode(
            sentence).ids, sentence
    assert tok.vocab_size == 30522 and tok.pad_id == 0
    assert {tok.cls_id, tok.sep_id, tok.mask_id, tok.pad_id} <= tok.special_ids


def test_wordpiece_decodes_and_reloads(tmp_path):
    tok = data.get_tokenizer('wordpiece')
    text = 'the quick brown fox jumps over the lazy dog, unbelievably.'
    assert tok.decode(tok.encode(text, add_special_tokens=True)) == text
    # A word the vocabulary lacks decodes as [UNK] where it was, not as nothing.
    assert tok.decode(tok.encode('the ☃ fox', add_special_tokens=True)) == 'the [UNK] fox'
    loaded = data.load_tokenizer(tok.save(str(tmp_path / 'wp')))
    assert loaded.encode(SENTENCES[2]) == tok.encode(SENTENCES[2])


def test_bad_kind_and_missing_dir_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown tokenizer kind 'sentencepiece'"):
        data.get_tokenizer('sentencepiece')
    with pytest.raises(FileNotFoundError, match='no saved tokenizer'):
        data.load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match='texts='):
        data.get_tokenizer('bpe')


def _word_file(path, words, specials=()):
    """A tiny word-level tokenizer.json: `words` in the vocabulary, `specials` added as
    the file's special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {w: i for i, w in enumerate(['[UNK]', *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(specials))
    tok.save(str(path))
    return str(path)


def test_a_tokenizer_file_roles_come_from_the_file_never_a_reserved_id(tmp_path, capsys):
    from attention_jax.errors import ConfigError
    from attention_jax.tasks import base
    words = ['the', 'cat', '<pad>', 'sat']
    # GPT-2's case: only an end-of-text token. It pads, and the choice is said once.
    (tmp_path / 'gpt').mkdir()
    path = _word_file(tmp_path / 'gpt' / 'tokenizer.json', words, ['<|endoftext|>'])
    tok = data.get_tokenizer('file', path=path)
    end = tok.hf.token_to_id('<|endoftext|>')
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (end, end, end) and end != 0
    note = capsys.readouterr().err.splitlines()
    assert note == [f"note: {path} has no pad token; using its eos token '<|endoftext|>' "
                    f"(id {end}) as pad (to choose another, name pad_token in a "
                    f"special_tokens_map.json beside it)"]
    loaded = data.load_tokenizer(tok.save(str(tmp_path / 'saved')))  # the choice kept, unsaid
    assert loaded.pad_id == end and capsys.readouterr().err == ''
    # '<pad>' as a plain word of the vocabulary is not taken for padding; named as the pad
    # token by the config file beside it, it is.
    (tmp_path / 'gpt' / 'special_tokens_map.json').write_text('{"pad_token": "<pad>"}')
    tok = data.get_tokenizer('file', path=path)
    assert (tok.pad_id, tok.eos_id) == (3, end) and tok.has_pad_token
    # GPT-2's own map names <|endoftext|> unk, bos and eos at once: decoding skips it as
    # the end token it is, while a file's unknown token of its own shows.
    (tmp_path / 'gpt' / 'special_tokens_map.json').write_text(
        '{"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>", '
        '"eos_token": "<|endoftext|>"}')
    tok = data.get_tokenizer('file', path=path)
    assert tok.unk_id == tok.eos_id == end
    assert tok.decode(tok.encode('the cat') + [end, end]) == 'the cat'
    (tmp_path / 'gpt' / 'special_tokens_map.json').unlink()
    own = data.get_tokenizer('file', path=_word_file(tmp_path / 'own.json', words,
                                                     ['[UNK]', '<|endoftext|>']))
    assert own.unk_id == 0 and own.decode(own.encode('the dog')) == 'the [UNK]'
    # No pad, end-of-text or beginning-of-text token: one line naming the file (and, from
    # a config, the config key), never id 0.
    bare = _word_file(tmp_path / 'bare.json', words)
    with pytest.raises(data.TokenizerFileError, match=r'bare\.json: no pad, end-of-text or '
                                                      r'beginning-of-text token'):
        data.get_tokenizer('file', path=bare)
    options = ml_collections.ConfigDict({'tokenizer': bare})
    with pytest.raises(ConfigError, match=r"^config\.data\.tokenizer='.*bare\.json': no pad"):
        base.run_tokenizer(options, str(tmp_path / 'run'), lambda: [], pad_may_be_eos=True)


def test_a_task_that_refuses_eos_as_pad_says_so_without_the_stand_in_note(tmp_path, capsys):
    """The seq2seq tasks tell padding by its id (an eos standing in would be masked out of
    the targets): they printed "note: ... using its eos token as pad" and then stopped on
    "error: ... has no pad token", the two contradicting."""
    from attention_jax.errors import ConfigError
    from attention_jax.tasks import base
    path = _word_file(tmp_path / 'tokenizer.json', ['the', 'cat'], ['</s>'])
    options = ml_collections.ConfigDict({'tokenizer': path})
    with pytest.raises(ConfigError, match=rf"^config\.data\.tokenizer='{path}': {path} has no "
                                          rf"pad token, and this task tells padding by its id"):
        base.run_tokenizer(options, str(tmp_path / 'run'), lambda: [])
    assert capsys.readouterr().err == ''
    # A task that pads by position takes the stand-in, and says so once.
    tok = base.run_tokenizer(options, str(tmp_path / 'run'), lambda: [], pad_may_be_eos=True)
    assert tok.pad_id == tok.eos_id and 'as pad' in capsys.readouterr().err


def test_bracketed_role_names_and_a_file_without_end_of_text(tmp_path, capsys):
    """A tokenizer trained with special tokens [PAD], [BOS], [EOS] had no eos at all
    (documents packed with nothing between them, samples never stopping) and bos was its
    pad, said wrongly; a file without any end-of-text token now says what that means."""
    words = ['the', 'cat', 'sat']
    path = _word_file(tmp_path / 'brackets.json', words, ['[PAD]', '[BOS]', '[EOS]'])
    tok = data.get_tokenizer('file', path=path)
    ids = {t: tok.hf.token_to_id(t) for t in ('[PAD]', '[BOS]', '[EOS]')}
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (ids['[PAD]'], ids['[BOS]'], ids['[EOS]'])
    assert capsys.readouterr().err == ''
    no_end = _word_file(tmp_path / 'no_end.json', words, ['<pad>', '<s>'])
    tok = data.get_tokenizer('file', path=no_end)
    assert tok.eos_id is None
    assert capsys.readouterr().err.splitlines() == [
        f"note: {no_end} has no end-of-text token (<|endoftext|>, </s>, <eos>, [EOS], "
        f"<|end_of_text|>, <|eot_id|>, [SEP]): packed documents run into each other with no "
        f"token between them, and samples stop only at their length (to name one, eos_token "
        f"in a special_tokens_map.json beside it)"]


def test_a_replaced_tokenizer_file_is_said_when_the_run_keeps_its_copy(tmp_path, capsys):
    """A run resumed with config.data.tokenizer's file replaced at the same path used its
    own copy, unsaid."""
    from attention_jax.tasks import base
    path = _word_file(tmp_path / 'tok.json', ['the', 'cat'], ['<|endoftext|>'])
    options = ml_collections.ConfigDict({'tokenizer': path})
    work = tmp_path / 'run'
    first = base.run_tokenizer(options, str(work), lambda: [], pad_may_be_eos=True)
    first.save(str(work / 'tokenizer'))
    capsys.readouterr()
    again = base.run_tokenizer(options, str(work), lambda: [], pad_may_be_eos=True)
    assert again.encode('the cat') == first.encode('the cat') and capsys.readouterr().err == ''
    _word_file(tmp_path / 'tok.json', ['a', 'dog', 'the', 'cat'], ['<|endoftext|>'])
    kept = base.run_tokenizer(options, str(work), lambda: [], pad_may_be_eos=True)
    assert kept.encode('the cat') == first.encode('the cat')  # the run's own vocabulary
    err = capsys.readouterr().err
    assert err.startswith(f"note: config.data.tokenizer={path!r} is not the file this run "
                          f"copied when it started; the run keeps its copy") and 'new workdir' in err


def test_ids_past_the_vocabulary_decode_to_nothing():
    """A model's vocabulary padded to a multiple of 64 can emit ids the tokenizer lacks:
    the char tokenizer raised IndexError on them (after a whole training run)."""
    for tok in (data.get_tokenizer('char', texts=[TEXT]), data.get_tokenizer('byte'),
                data.get_tokenizer('bpe', texts=_corpus(), vocab_size=300)):
        ids = tok.encode('def f(x)')  # characters of TEXT: none unknown to the char one
        assert tok.decode([*ids, tok.vocab_size, tok.vocab_size + 40]) == 'def f(x)'


def _bpe_file_lacking_its_unk(path, texts):
    """A BPE tokenizer.json trained on `texts` whose model names '<unk>' as its unknown
    token but which never got it as a token (a mistake easy to make when training one):
    only characters of `texts` have ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token='<unk>'))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=['<|endoftext|>'], show_progress=False))
    tok.save(str(path))
    return str(path)


def test_a_text_the_tokenizer_cannot_encode_is_named_and_so_are_the_prompts(tmp_path):
    """The tokenizers library's bare "Unk token `<unk>` not found in the vocabulary"
    becomes one error naming the file, the text and why; the GPT task checks its sample
    prompts with it before training (a run used to train, then crash when it sampled)."""
    from attention_jax.errors import ConfigError, UserError
    from attention_jax.tasks import text
    path = _bpe_file_lacking_its_unk(tmp_path / 'tokenizer.json', ['12 is twelve'] * 50)
    tok = data.get_tokenizer('file', path=path)
    assert tok.decode(tok.encode('twelve is 21')) == 'twelve is 21'
    with pytest.raises(data.TokenizerEncodeError) as raised:
        tok.encode('Grüße')
    assert isinstance(raised.value, UserError) and isinstance(raised.value, ValueError)
    assert str(raised.value).startswith(
        f"{path} cannot encode 'Grüße' (Unk token `<unk>` not found in the vocabulary): its "
        f"model names the unknown token '<unk>', which its vocabulary lacks")
    text.check_sample_prompts(('12 ', 'twelve'), tok)
    text.check_sample_prompts((), tok)  # no prompts: nothing to sample
    with pytest.raises(ConfigError, match=r"^config\.eval\.sample_prompts: .* cannot encode "
                                          r"'def ' .*; valid: prompts it encodes"):
        text.check_sample_prompts(('12 ', 'def '), tok)
    # A prompt that fills a learned position table: refused before training, not when the
    # finished run samples (it exited 1 after training).
    n = len(tok.encode('12 is twelve'))
    text.check_sample_prompts(('12 is twelve',), tok, max_len=n + 1)
    with pytest.raises(ConfigError, match=rf"^config\.eval\.sample_prompts: '12 is twelve' is "
                                          rf"{n} tokens, which fill the position table "
                                          rf"\(model\.max_len={n}\)"):
        text.check_sample_prompts(('12 is twelve',), tok, max_len=n)


def test_remote_folders_go_through_the_workdir(tmp_path):
    """One way to gs:// and s3://: workdir.save_assets and workdir.local_dir (tested
    against a bucket emulator in tests/system/test_object_store.py), never a local
    folder named 'gs:'."""
    tok = data.get_tokenizer('byte')
    with pytest.raises(ValueError, match=r"^Tokenizer\.save writes a local folder; got "
                                         r"'gs://b/run/tokenizer': .*workdir\.save_assets"):
        tok.save('gs://b/run/tokenizer')
    with pytest.raises(FileNotFoundError, match=r"no saved tokenizer in 's3://b/t' here: "
                                                r".*workdir\.local_dir"):
        data.load_tokenizer('s3://b/t')


def test_a_bpe_file_that_drops_what_it_has_no_id_for_is_said(tmp_path, capsys):
    """A BPE tokenizer.json with no unknown token (or byte-level, trained without every
    byte) encodes a character it never saw as nothing: 'ZZZZ 日本語' was a document of no
    tokens, unsaid. Loading it now says so; a complete byte-level one is quiet."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    texts = ['hello world abc'] * 20
    cases = {}
    for name, pre, alphabet in (('words', pre_tokenizers.Whitespace(), []),
                                ('bytes', pre_tokenizers.ByteLevel(), []),
                                ('all_bytes', pre_tokenizers.ByteLevel(),
                                 pre_tokenizers.ByteLevel.alphabet())):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre
        tok.train_from_iterator(texts, trainers.BpeTrainer(
            vocab_size=300, special_tokens=['<|endoftext|>'], initial_alphabet=alphabet,
            show_progress=False))
        tok.save(str(tmp_path / f'{name}.json'))
        capsys.readouterr()
        loaded = data.get_tokenizer('file', path=str(tmp_path / f'{name}.json'))
        cases[name] = (loaded.encode('ZZZZ'), capsys.readouterr().err)
    assert cases['words'][0] == []  # what the note is about: the text is gone
    assert (f"note: {tmp_path / 'words.json'}: it has no unknown token, and a character it "
            f"never saw in training has no id, so a text holding one loses it, unsaid") \
        in cases['words'][1]
    assert len(cases['bytes'][0]) < 4 and "its byte-level vocabulary lacks " in cases['bytes'][1]
    assert len(cases['all_bytes'][0]) >= 1 and 'loses it' not in cases['all_bytes'][1]
