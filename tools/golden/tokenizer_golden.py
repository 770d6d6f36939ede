"""Golden values for our C++ tokenizer (//tokenizer): byte-level BPE tokenizers
trained here with Hugging Face `tokenizers`, and the ids `tokenizers` gives for
a corpus of test strings.

Run from the repo root with the venv's Python (`tokenizers` 0.23.3, which
transformers 5.24.0 pulls in; nothing is downloaded):

    ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3 \
        tools/golden/tokenizer_golden.py

It rewrites tokenizer/testdata/ (deterministic: the trainer is fed the same
text in the same order; about 1 MB in all):

  strings.json            the test strings, a JSON list of str: excerpts of
                          licence texts, C/C++ headers and man-page source
                          from this machine (files every Debian 12 with the
                          project's packages has), several languages, and the
                          hand-written cases below (CASES).
  <case>/tokenizer.json   the tokenizer, as `Tokenizer.save` writes it (the
                          gpt2 cases' merges rewritten in the older "a b"
                          string form, which `tokenizers` still reads: both
                          forms are covered).
  <case>/expected.json    what `tokenizers` computes with it:
      ids                 [[int]]: encode(s, add_special_tokens=False).ids for
                          each string of strings.json;
      prefix, suffix      [int]: what encode(s, add_special_tokens=True) adds
                          around those ids (the post-processor's template;
                          asserted for every string);
      decoded             [str | null]: decode(ids, skip_special_tokens=False),
                          null where it equals the string itself;
      decoded_skip        [str | null]: decode(ids, skip_special_tokens=True),
                          null where it equals decoded (or the string);
      decode_cases        [{ids, text, text_skip}]: id sequences made of the
                          single-byte tokens, spelling invalid UTF-8 (a
                          character cut across tokens, lone continuation
                          bytes, overlong forms, surrogates, 0xFF) between
                          special tokens, and what decode gives (U+FFFD for
                          each maximal invalid subpart);
      invalid_utf8        [{hex, ids}]: byte strings that are not UTF-8 and the
                          ids of their bytes.decode("utf-8", "replace") (what
                          our EncodeOptions::InvalidUtf8::kReplace promises;
                          Python cannot hand `tokenizers` the bytes
                          themselves);
      vocab               {"size": largest id + 1, "special": [ids]}.

Cases (vocabularies trained on the licence texts, man pages and headers):

  gpt2         GPT-2's layout: ByteLevel pre-tokenizer (its own regex,
               add_prefix_space false), <|endoftext|> in the model's
               vocabulary (trained as a special token, "normalized": true as
               in GPT-2's file), ByteLevel post-processor and decoder, vocab
               3000, merges as "a b" strings.
  gpt2_prefix  gpt2 with the pre-tokenizer's add_prefix_space true.
  llama3       Llama 3's layout: Split(Llama 3's regex: contractions in any
               case, digits in groups of 1-3) then ByteLevel(use_regex
               false), "ignore_merges": true, Llama 3's special tokens added
               after the vocabulary (<|begin_of_text|> ... <|eot_id|>, not
               normalized), post-processor Sequence[ByteLevel,
               TemplateProcessing("<|begin_of_text|> $A")], vocab 4000.
  qwen2        Qwen2's layout: NFC normalizer, Split(Qwen2's regex: single
               digits) then ByteLevel, <|endoftext|>, <|im_start|>,
               <|im_end|> added after the vocabulary, ByteLevel
               post-processor and decoder, vocab 4000.
  flags        the added-token options: an NFKC normalizer, a vocabulary
               trained without the full byte alphabet (vocab 600) with
               unk_token "<unk>" and fuse_unk, and added tokens with lstrip
               ("<mask>", special), rstrip ("<r>"), single_word ("[word]",
               normalized) and a normalized token whose text NFKC changes
               ("ﬁle", matching "file").
  flags_nounk  flags without unk_token: bytes missing from the vocabulary
               are dropped, as `tokenizers` drops them.
"""

import glob
import gzip
import json
import os
import shutil

import tokenizers
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(REPO, "tokenizer", "testdata")

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                  "<|python_tag|>"]
QWEN2_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Files of this machine (Debian 12 with the project's packages).
LICENCES = sorted(glob.glob("/usr/share/common-licenses/*"))
HEADERS = ["/usr/include/stdio.h", "/usr/include/absl/strings/str_split.h",
           "/usr/include/absl/strings/ascii.h", "/usr/include/gtest/gtest.h"]
MAN_PAGES = ["/usr/share/man/man1/ls.1.gz", "/usr/share/man/man1/bash.1.gz",
             "/usr/share/man/man1/cp.1.gz", "/usr/share/man/man1/grep.1.gz"]

MULTILINGUAL = [
    "Über den Wolken muss die Freiheit wohl grenzenlos sein. Straße, Größe, Äpfel.",
    "Le cœur a ses raisons que la raison ne connaît point. L'été, c'est déjà là !",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Ξεσκεπάζω τὴν ψυχοφθόρα βδελυγμία. Αυτό είναι ελληνικά.",
    "صِف خَلقَ خَودِ كَمِثلِ الشَمسِ إِذ بَزَغَت",
    "ऋषियों को सताने वाले दुष्ट राक्षसों के राजा रावण का सर्वनाश करने वाले",
    "我能吞下玻璃而不伤身体。今天天气很好，我们去公园散步吧！",
    "私はガラスを食べられます。それは私を傷つけません。カタカナとひらがな。",
    "나는 유리를 먹을 수 있어요. 그래도 아프지 않아요. 한국어 텍스트입니다.",
    "אני יכול לאכול זכוכית וזה לא מזיק לי.",
    "ฉันกินกระจกได้ แต่มันไม่ทำให้ฉันเจ็บ",
    "Tôi có thể ăn thủy tinh mà không hại gì.",
]

# Hand-written cases: the pre-tokenizers' corners, each special token, text that
# the normalizers change, characters of every width.
CASES = [
    "",
    " ",
    "a",
    "Hello, world!",
    "  leading spaces and trailing  ",
    "many     spaces    between     words",
    "tabs\tand\t\ttabs\t",
    "new\nlines\n\nand\r\nCRLF\r\n",
    "\n\n\n",
    " \n \n ",
    "trailing newline\n",
    "mixed \t\n \t whitespace \u00a0nbsp \u3000ideographic\u2003em",
    "a\x85b next-line: a\x85\x85b",
    "line\u2028separator\u2029paragraph",
    "1 12 123 1234 12345 123456 1234567 3.14159 1,000,000 2026-11-26",
    "٣٤٥٦ ١٢٣ ۱۲۳۴ १२३४५ ⅣⅤ ½ ² ①②",
    "I'm you're he's we've they'll I'd it's can't",
    "I'M YOU'RE HE'S WE'VE THEY'LL I'D IT'S CAN'T",
    "I'm You'Re He'S We'vE They'Ll I'D",
    "x'ſt x'Kt x'LLama x'ǈama x'İs",
    "''s 's 'S '' ' '  's",
    "don’t — ‘quotes’ “double”",
    "CJK: 漢字かなカナ한글 中文，标点。",
    "emoji: 😀 👍🏽 🇩🇪 ❤️ 👨‍👩‍👧‍👦 🏳️‍🌈 👩🏽‍💻",
    "combining: e\u0301 a\u0308 n\u0303 o\u0302\u0323 \u0301alone",
    "precomposed: é ä ñ ộ",
    "ligatures and compatibility: ﬁle ﬀ ① ｆｕｌｌｗｉｄｔｈ ㎏ ℌ Å Ω",
    "Hangul jamo: \u1100\u1161\u11a8 and 각",
    "zero width: a\u200bb a\u200cb a\u200db \ufeffbom",
    "control: \x00\x01\x07\x1b[0m\x7f",
    "symbols: ∀x∈ℝ: x²≥0 → ∑∫∂ ≠ ≤ ± € £ ¥ © ® ™",
    "code: for (int i = 0; i < n; ++i) { x[i] += y[i] * 2; }  // done",
    "def f(x):\n    return x ** 2  # square\n",
    "<html><body class=\"a\">&amp;&lt;</body></html>",
    "snake_case camelCase PascalCase SCREAMING_CASE kebab-case",
    "https://example.com/path?q=1&r=two#frag user@example.org",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "!!!!!!!!!!????????........,,,,,,,,;;;;;;;;::::::::",
    "Supercalifragilisticexpialidocious antidisestablishmentarianism",
    # Special tokens of every case, alone, glued to text, adjacent, inside words.
    "<|endoftext|>",
    "<|endoftext|><|endoftext|>",
    "Hello<|endoftext|>world",
    "Hello <|endoftext|> world",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>",
    "<|begin_of_text|>",
    "<|end_of_text|> <|reserved_special_token_0|><|reserved_special_token_1|>",
    "<|finetune_right_pad_id|><|eom_id|><|python_tag|>x",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "<|im_start|><|im_end|>",
    "almost special: <|endoftext| <|im_start <|eot_id |> <| |>",
    "nested <|im_<|im_end|>start|>",
    # The flags case's added tokens.
    "a <mask> b  <mask>c\t<mask>",
    "<r>   x <r>\n y<r>",
    "[word] a[word] [word]b ([word]) é[word] [word]_x [word]",
    "file ﬁle profile ﬁles",
    "<mask><r>[word]file",
    # Bytes the flags vocabulary lacks: unk, fused or not, and dropped.
    "ünïcödé ☃ 中",
]


def read_text(path):
    if path.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            data = f.read()
    else:
        with open(path, "rb") as f:
            data = f.read()
    return data.decode("utf-8", "replace")


def training_texts():
    texts = [read_text(p) for p in LICENCES]
    texts += [read_text(p) for p in HEADERS + MAN_PAGES]
    texts += MULTILINGUAL
    return texts


def test_strings():
    strings = []
    for p in LICENCES[::2]:  # every other licence, its start and a middle part
        t = read_text(p)
        strings.append(t[:1200])
        strings.append(t[len(t) // 2:len(t) // 2 + 600])
    for p in HEADERS + MAN_PAGES:
        t = read_text(p)
        strings.append(t[:1500])
    strings += MULTILINGUAL
    strings.append("\n".join(MULTILINGUAL))
    strings += CASES
    return strings


def byte_level_chars():
    """GPT-2's bytes_to_unicode, from tokenizers itself: alphabet() lists the
    256 characters; the printable bytes are themselves, the rest follow in
    byte order from U+0100."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    assert len(alphabet) == 256
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
                 + list(range(0xAE, 0xFF + 1)))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    assert set(chars.values()) == alphabet
    return chars


def train(model, pre_tokenizer, vocab_size, texts, normalizer=None, special=(),
          initial_alphabet=True):
    tok = Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if initial_alphabet else [])
    tok.train_from_iterator(texts, trainer)
    return tok


def build_cases(texts):
    cases = {}

    gpt2 = train(models.BPE(), pre_tokenizers.ByteLevel(add_prefix_space=False), 3000, texts,
                 special=["<|endoftext|>"])
    gpt2.post_processor = processors.ByteLevel(trim_offsets=False)
    j = json.loads(gpt2.to_str())
    for t in j["added_tokens"]:
        t["normalized"] = True  # as in GPT-2's own file
    j["model"]["merges"] = [" ".join(m) for m in j["model"]["merges"]]
    cases["gpt2"] = j
    jp = json.loads(json.dumps(j))
    jp["pre_tokenizer"]["add_prefix_space"] = True
    cases["gpt2_prefix"] = jp

    llama3 = train(models.BPE(ignore_merges=True), pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)]),
        4000, texts)
    llama3.add_special_tokens(LLAMA3_SPECIAL)
    bos = llama3.token_to_id("<|begin_of_text|>")
    llama3.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
        processors.TemplateProcessing(
            single="<|begin_of_text|> $A:0",
            pair="<|begin_of_text|> $A:0 <|begin_of_text|> $B:1",
            special_tokens=[("<|begin_of_text|>", bos)])])
    cases["llama3"] = json.loads(llama3.to_str())

    qwen2 = train(models.BPE(ignore_merges=False), pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]),
        4000, texts, normalizer=normalizers.NFC())
    qwen2.add_special_tokens(QWEN2_SPECIAL)
    qwen2.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                use_regex=False)
    qwen2.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                       use_regex=False)
    cases["qwen2"] = json.loads(qwen2.to_str())

    ascii_texts = ["".join(c for c in t if ord(c) < 128) for t in texts[:6]]
    flags = train(models.BPE(unk_token="<unk>", fuse_unk=True),
                  pre_tokenizers.ByteLevel(add_prefix_space=False), 600, ascii_texts,
                  normalizer=normalizers.NFKC(), special=["<unk>"], initial_alphabet=False)
    flags.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True, normalized=False)])
    flags.add_tokens([AddedToken("<r>", rstrip=True, normalized=False),
                      AddedToken("[word]", single_word=True, normalized=True),
                      AddedToken("ﬁle", normalized=True)])
    flags.post_processor = processors.ByteLevel(trim_offsets=False)
    j = json.loads(flags.to_str())
    cases["flags"] = j
    jn = json.loads(json.dumps(j))
    jn["model"]["unk_token"] = None
    cases["flags_nounk"] = jn
    return cases


def decode_cases(tok, chars, specials):
    """Id sequences of single-byte tokens that are not UTF-8, between special tokens."""
    def b(*bs):
        return [tok.token_to_id(chars[x]) for x in bs]
    sp = [tok.token_to_id(s) for s in specials][:1]
    seqs = [
        b(0xE2, 0x82) + b(0x61),                    # a cut euro sign, then 'a'
        b(0xE2) + b(0x82, 0xAC),                    # the euro sign across two tokens: valid
        b(0xF0, 0x9F, 0x98) + sp + b(0x80) + b(0x61),  # a cut emoji around a special token
        b(0x80, 0x80, 0x61),                        # lone continuation bytes
        b(0xFF, 0xFE, 0x61),
        b(0xC0, 0xAF),                              # overlong '/'
        b(0xED, 0xA0, 0x80),                        # a surrogate
        b(0xF4, 0x90, 0x80, 0x80),                  # above U+10FFFF
        b(0xF0, 0x80, 0x80),
        b(0xE0, 0x80, 0x61),
        b(0xC3) + sp + b(0xA9),                     # é cut by a special token
        sp + b(0x61) + sp,
    ]
    out = []
    for ids in seqs:
        if any(i is None for i in ids):
            continue  # a byte the vocabulary lacks (the flags cases)
        out.append({"ids": ids, "text": tok.decode(ids, skip_special_tokens=False),
                    "text_skip": tok.decode(ids, skip_special_tokens=True)})
    return out


INVALID_UTF8 = ["61e282", "e282ac20e2822061", "ff", "c0af78", "eda080", "f09f9880f09f98",
                "2020808020", "3c7c656e646f66746578747c3efe3c7c656e646f66746578747c3e",
                "6869c3", "cafe20c3a9"]


def expected(tok, strings, chars, specials):
    ids, decoded, decoded_skip = [], [], []
    prefix = suffix = None
    for s in strings:
        plain = tok.encode(s, add_special_tokens=False).ids
        full = tok.encode(s, add_special_tokens=True).ids
        if prefix is None:
            empty_full = tok.encode("", add_special_tokens=True).ids
            prefix, suffix = empty_full, []
        assert full == prefix + plain + suffix, (s, full, plain)
        ids.append(plain)
        d = tok.decode(plain, skip_special_tokens=False)
        ds = tok.decode(plain, skip_special_tokens=True)
        decoded.append(None if d == s else d)
        decoded_skip.append(None if ds == d else ds)
    invalid = []
    for h in INVALID_UTF8:
        text = bytes.fromhex(h).decode("utf-8", "replace")
        invalid.append({"hex": h, "ids": tok.encode(text, add_special_tokens=False).ids})
    vocab = tok.get_vocab(with_added_tokens=True)
    special = sorted({tok.token_to_id(t.content) for t in tok.get_added_tokens_decoder().values()
                      if t.special})
    return {"ids": ids, "prefix": prefix, "suffix": suffix, "decoded": decoded,
            "decoded_skip": decoded_skip, "decode_cases": decode_cases(tok, chars, specials),
            "invalid_utf8": invalid,
            "vocab": {"size": max(vocab.values()) + 1, "special": special}}


def dump(obj, path):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")


def main():
    texts = training_texts()
    strings = test_strings()
    chars = byte_level_chars()
    specials = {"gpt2": ["<|endoftext|>"], "gpt2_prefix": ["<|endoftext|>"],
                "llama3": LLAMA3_SPECIAL, "qwen2": QWEN2_SPECIAL,
                "flags": ["<mask>"], "flags_nounk": ["<mask>"]}
    # Its own files only: testdata/sentencepiece/ is sentencepiece_golden.py's.
    for name in specials:
        if os.path.isdir(os.path.join(OUT, name)):
            shutil.rmtree(os.path.join(OUT, name))
    os.makedirs(OUT, exist_ok=True)
    dump(strings, os.path.join(OUT, "strings.json"))
    for name, j in build_cases(texts).items():
        d = os.path.join(OUT, name)
        os.makedirs(d)
        path = os.path.join(d, "tokenizer.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(j, f, ensure_ascii=False, indent=1)
            f.write("\n")
        tok = Tokenizer.from_file(path)  # what the C++ side reads
        exp = expected(tok, strings, chars, specials[name])
        dump(exp, os.path.join(d, "expected.json"))
        n = sum(len(i) for i in exp["ids"])
        print(f"{name}: vocab {exp['vocab']['size']}, {n} ids for {len(strings)} strings "
              f"({sum(len(s.encode()) for s in strings)} bytes), prefix {exp['prefix']}")
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(OUT) for f in fs)
    print(f"wrote {os.path.relpath(OUT, REPO)} ({total / 1024:.0f} KiB; tokenizers "
          f"{tokenizers.__version__})")


if __name__ == "__main__":
    main()
