"""Golden values for our tokenizer's SentencePiece tokenizer.model support
(//tokenizer's Tokenizer::FromFile on a .model, run by Debian's
libsentencepiece 0.1.97): small SentencePiece models trained here with the
Python `sentencepiece` library, and the ids that transformers'
sentencepiece-backed ("slow") Llama tokenizer gives for the test strings.

Run from the repo root with the venv's Python (sentencepiece 0.2.3,
transformers 5.24.0 and tokenizers 0.23.3, protobuf for transformers'
conversion; all from `tools/setup.sh --with-python`; nothing is downloaded):

    ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3 \\
        tools/golden/sentencepiece_golden.py

It rewrites tokenizer/testdata/sentencepiece/ (and nothing else of
tokenizer/testdata/, which tools/golden/tokenizer_golden.py writes; the test
strings are that script's strings.json, read from there, plus the cases
below):

  strings.json            the SentencePiece cases (SP_CASES), appended to
                          ../strings.json's strings by the tests.
  <case>/tokenizer.model  the model, as the trainer writes it.
  <case>/expected.json    for each string of ../strings.json then
                          strings.json:
      indices             [int]: the strings covered (llama2_bpe: all; the
                          others: those of at most 400 bytes);
      ids                 [[int]]: the ids without special tokens: the
                          string split on the model's special pieces (its
                          control pieces and the unknown piece: <s>, </s>,
                          <unk>, ...) as transformers' tokenizer splits on its
                          special tokens, each piece between them through
                          sentencepiece's encode (transformers 5's
                          SentencePieceBackend, legacy=True: the "slow"
                          LlamaTokenizer of transformers 4; asserted equal to
                          sentencepiece on each piece);
      prefix              [int]: what add_special_tokens adds before them:
                          the model's BOS (LlamaTokenizer's add_bos_token
                          True, add_eos_token False), [] without one;
      decoded             [str | null]: the decode of ids with the special
                          pieces written as spelled (skip_special_tokens=
                          False), null where it equals the string;
      decoded_skip        [str | null]: the decode of prefix + ids without
                          them (skip_special_tokens=True): sentencepiece's
                          decode of the other ids; null where it equals
                          decoded (or the string);
      decode_cases        [{ids, text, text_skip}]: byte pieces spelling
                          invalid UTF-8 (a character cut, lone continuation
                          bytes, overlong forms, surrogates, 0xFF, above
                          U+10FFFF) around special pieces and text, and what
                          sentencepiece's decode gives (U+FFFD for each byte
                          that does not begin a character); byte-fallback
                          models only;
      invalid_utf8        [{hex, ids}]: byte strings that are not UTF-8 and
                          the ids of bytes.decode("utf-8", "replace");
      vocab               {"size", "bos", "eos", "unk", "pad" (null where the
                          model has none), "special": [ids]}.

The two decodes follow sentencepiece: each piece's text with "▁" as a space,
byte pieces their byte, the dummy prefix's space dropped at the start (one
"▁"; every leading "▁" for a model that removes extra whitespace), U+FFFD per
invalid byte. Where special pieces are written (decoded), a run of other ids
after one keeps its leading space, as transformers' LlamaTokenizer writes
"<s> Hello" (computed with sentencepiece: the run decoded after a piece that
ends the start, whose text is then taken off).

Cases (trained on the licence texts, man pages and headers that
tokenizer_golden.py reads):

  llama2_bpe       Llama 2's trainer settings: BPE, byte_fallback,
                   split_digits, allow_whitespace_only_pieces, identity
                   normalization, remove_extra_whitespaces false, unk 0,
                   bos 1, eos 2, no pad; vocab 2000.
  unigram          unigram, remove_extra_whitespaces (sentencepiece's
                   default), no byte fallback (characters outside the
                   vocabulary are <unk>), a <pad> (3), a control symbol <ctl>
                   and a user-defined symbol <user>; vocab 1000.
  bpe_nodummy      BPE without the dummy prefix (add_dummy_prefix false,
                   remove_extra_whitespaces false): decoding keeps every
                   space; no BOS (bos -1: add_special_tokens adds nothing),
                   eos 1; byte fallback; vocab 800.
  unigram_nodummy  unigram without the dummy prefix but removing extra
                   whitespace, byte fallback; vocab 600.

All four with identity normalization: nmt_nfkc's precompiled table alone is
240 KB a model, and the normalizer is the library's own code.

For llama2_bpe the script also compares transformers 5's LlamaTokenizer (the
`tokenizers`-backed one, converted from the model, legacy=True) and prints on
how many strings its ids and decodes differ: it is not the reference
(its Metaspace pre-tokenizer adds no "▁" before text that starts with a space,
and its BPE is `tokenizers`' on converted merges).
"""

import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tokenizer_golden as tg  # noqa: E402  (the strings and training texts)

import sentencepiece as spm  # noqa: E402
import transformers  # noqa: E402
from transformers.tokenization_utils_sentencepiece import SentencePieceBackend  # noqa: E402

OUT = os.path.join(tg.OUT, "sentencepiece")

SP_CASES = [
    "<s>",
    "</s>",
    "<unk>",
    "<pad>",
    "<ctl>",
    "<user>",
    "<s>Hello</s>",
    "<s> Hello </s>",
    "a<s> b",
    " <unk> x",
    "<s><s></s></s>",
    "Hello <s> world </s> again",
    "half-written: <s <s/> </s <unk <un k> <0x41> <0xZZ> < s>",
    "<user>x<ctl>y<pad>z <user> <user><user>",
    "▁ a literal lower one eighth block ▁▁x▁",
    "outside the vocabulary: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ 𓀀 🦩 ᚠᛇᚻ ☃ 中",
    "   ",
    "\t",
    "x  ",
    " leading",
    "trailing ",
    "  two  leading and trailing  ",
    "digits 0123456789 ٠١٢ 10000000 3.14",
    "[INST] <<SYS>>\nYou are helpful.\n<</SYS>>\n\nHi there [/INST] Hello! </s><s>[INST] Bye [/INST]",
]


def training_lines():
    lines = []
    for text in tg.training_texts():
        lines += [line for line in text.split("\n") if line.strip()]
    return lines


def train(name, **options):
    # In a directory of its own, with a relative model_prefix: the model
    # records it (trainer_spec.model_prefix), so the bytes do not depend on
    # the directory.
    here, directory = os.getcwd(), tempfile.mkdtemp()
    os.chdir(directory)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(training_lines()), model_prefix=name, num_threads=1,
            minloglevel=2, **options)
        with open(name + ".model", "rb") as f:
            return f.read()
    finally:
        os.chdir(here)
        shutil.rmtree(directory)


def build_models():
    llama2 = dict(model_type="bpe", byte_fallback=True, split_digits=True,
                  allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
                  normalization_rule_name="identity", character_coverage=0.99995,
                  max_sentencepiece_length=16, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    # Identity normalization everywhere: nmt_nfkc's precompiled table alone
    # is 240 KB per model (the normalizer is the library's own code anyway).
    return {
        "llama2_bpe": train("llama2_bpe", vocab_size=2000, **llama2),
        "unigram": train("unigram", model_type="unigram", vocab_size=1000,
                         normalization_rule_name="identity", pad_id=3,
                         control_symbols=["<ctl>"], user_defined_symbols=["<user>"]),
        "bpe_nodummy": train("bpe_nodummy", model_type="bpe", vocab_size=800,
                             byte_fallback=True, add_dummy_prefix=False,
                             remove_extra_whitespaces=False,
                             normalization_rule_name="identity", unk_id=0, bos_id=-1,
                             eos_id=1, pad_id=-1),
        "unigram_nodummy": train("unigram_nodummy", model_type="unigram", vocab_size=600,
                                 byte_fallback=True, add_dummy_prefix=False,
                                 normalization_rule_name="identity"),
    }


# The cases other than llama2_bpe take the strings of at most this many bytes
# (the hand-written cases, the languages; not the long excerpts), to keep
# testdata small.
SHORT = 400


class Reference:
    """The model as transformers' sentencepiece-backed tokenizer runs it, and
    the decodes computed with sentencepiece."""

    def __init__(self, path):
        self.sp = spm.SentencePieceProcessor(model_file=path)
        sp = self.sp
        n = sp.get_piece_size()
        self.special = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
        names = {}
        for role, i in (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()),
                        ("unk_token", sp.unk_id()), ("pad_token", sp.pad_id())):
            if i >= 0:
                names[role] = sp.id_to_piece(i)
        reserved = set(names.values())
        extra = [sp.id_to_piece(i) for i in self.special if sp.id_to_piece(i) not in reserved]
        self.hf = SentencePieceBackend(vocab_file=path, legacy=True,
                                       extra_special_tokens=extra, **names)
        assert sorted(self.hf.all_special_ids) == self.special, (self.hf.all_special_ids,
                                                                 self.special)
        self.bos = [sp.bos_id()] if sp.bos_id() >= 0 else []
        # A piece that ends the start (the dummy prefix's space is no longer
        # dropped after it): a byte piece, else <unk>.
        byte = sp.piece_to_id("<0x41>")
        self.starter = byte if sp.is_byte(byte) else sp.unk_id()
        self.starter_text = sp.decode([self.starter])

    def ids(self, text):
        ids = self.hf.convert_tokens_to_ids(self.hf.tokenize(text))
        # The same, from sentencepiece itself on the pieces between specials.
        own, rest = [], text
        pieces = {self.sp.id_to_piece(i): i for i in self.special}
        while rest:
            hits = [(rest.find(p), -len(p), p) for p in pieces if rest.find(p) >= 0]
            if not hits:
                own += self.sp.encode(rest)
                break
            at, _, p = min(hits)
            own += self.sp.encode(rest[:at]) + [pieces[p]]
            rest = rest[at + len(p):]
        assert ids == own, (text, ids, own)
        return ids

    def decode(self, ids, skip):
        special = set(self.special)
        if skip:
            return self.sp.decode([i for i in ids if i not in special])
        out, run = "", []

        def flush():
            nonlocal out
            if not run:
                return
            if out:  # after a special piece: no space dropped
                text = self.sp.decode([self.starter] + run)
                assert text.startswith(self.starter_text)
                out += text[len(self.starter_text):]
            else:
                out += self.sp.decode(run)
            run.clear()

        for i in ids:
            if i in special:
                flush()
                out += self.sp.id_to_piece(i)
            else:
                run.append(i)
        flush()
        return out


def decode_cases(ref):
    sp = ref.sp
    if not sp.is_byte(sp.piece_to_id("<0xE6>")):
        return []

    def b(*values):
        return [sp.piece_to_id("<0x%02X>" % v) for v in values]

    word = ref.ids(" world")
    specials = ref.special
    first = specials[1] if len(specials) > 1 else specials[0]
    sequences = [
        b(0xE6, 0x97),                      # a character cut
        b(0xE6, 0x97) + word,
        b(0xE6, 0x97, 0xA5),                # whole
        b(0xE6, 0x97, 0xA5, 0xE6),
        b(0x97, 0x97, 0x41),                # lone continuation bytes
        b(0xC0, 0xAF),                      # overlong
        b(0xED, 0xA0, 0x80),                # a surrogate
        b(0xFF),
        b(0xF4, 0x90, 0x80, 0x80),          # above U+10FFFF
        b(0xF0, 0x9F, 0x98) + [first] + b(0x80),
        b(0xE6) + [first] + b(0x97, 0xA5),  # cut by a special piece
        [first] + word + b(0xE6, 0x97),
        b(0x41) + word,                     # a byte first: the space stays
        [first] + [first] + word,
    ]
    return [{"ids": ids, "text": ref.decode(ids, False), "text_skip": ref.decode(ids, True)}
            for ids in sequences]


INVALID_UTF8 = [b"\xff", b"abc\xe6\x97", b"\xe6\x97abc", b"\xc0\xaf<s>\xed\xa0\x80",
                b"x\x80\x80y", b"\xf4\x90\x80\x80 z"]


def expected(ref, strings, indices):
    sp = ref.sp
    exp = {"indices": indices, "ids": [], "prefix": ref.bos, "decoded": [], "decoded_skip": []}
    for s in (strings[i] for i in indices):
        ids = ref.ids(s)
        exp["ids"].append(ids)
        decoded = ref.decode(ids, False)
        decoded_skip = ref.decode(ref.bos + ids, True)
        exp["decoded"].append(None if decoded == s else decoded)
        exp["decoded_skip"].append(None if decoded_skip in (decoded, s) else decoded_skip)
    exp["decode_cases"] = decode_cases(ref)
    exp["invalid_utf8"] = [{"hex": b.hex(), "ids": ref.ids(b.decode("utf-8", "replace"))}
                           for b in INVALID_UTF8]

    def reserved(i):
        return i if i >= 0 else None

    exp["vocab"] = {"size": sp.get_piece_size(), "bos": reserved(sp.bos_id()),
                    "eos": reserved(sp.eos_id()), "unk": reserved(sp.unk_id()),
                    "pad": reserved(sp.pad_id()), "special": ref.special}
    return exp


def compare_with_fast(directory, ref, strings, exp):
    """transformers 5's LlamaTokenizer (converted to `tokenizers`) on the
    same strings: printed, not recorded."""
    tok = transformers.LlamaTokenizer.from_pretrained(directory, legacy=True)
    ids_differ = decoded_differ = 0
    for s, ids, decoded in zip(strings, exp["ids"], exp["decoded"]):
        if tok.encode(s, add_special_tokens=False) != ids:
            ids_differ += 1
        if tok.decode(ids, skip_special_tokens=False) != (s if decoded is None else decoded):
            decoded_differ += 1
        if tok.decode(ref.bos + ids, skip_special_tokens=False) != ref.decode(ref.bos + ids,
                                                                              False):
            decoded_differ += 1
    print(f"  transformers {transformers.__version__} LlamaTokenizer (tokenizers-backed, "
          f"legacy=True): ids differ on {ids_differ} of {len(strings)} strings, decodes "
          f"(with and without the BOS) on {decoded_differ}")


def main():
    with open(os.path.join(tg.OUT, "strings.json"), encoding="utf-8") as f:
        strings = json.load(f) + SP_CASES
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    tg.dump(SP_CASES, os.path.join(OUT, "strings.json"))
    for name, model in build_models().items():
        d = os.path.join(OUT, name)
        os.makedirs(d)
        path = os.path.join(d, "tokenizer.model")
        with open(path, "wb") as f:
            f.write(model)
        ref = Reference(path)
        indices = [i for i, s in enumerate(strings)
                   if name == "llama2_bpe" or len(s.encode()) <= SHORT]
        exp = expected(ref, strings, indices)
        tg.dump(exp, os.path.join(d, "expected.json"))
        n = sum(len(i) for i in exp["ids"])
        print(f"{name}: {exp['vocab']['size']} pieces, {n} ids for {len(indices)} strings, "
              f"prefix {exp['prefix']}, specials {exp['vocab']['special']}")
        if name == "llama2_bpe":
            compare_with_fast(d, ref, strings, exp)
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(OUT) for f in fs)
    print(f"wrote {os.path.relpath(OUT, tg.REPO)} ({total / 1024:.0f} KiB; sentencepiece "
          f"{spm.__version__}, transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
