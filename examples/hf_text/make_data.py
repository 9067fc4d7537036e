"""Write tiny synthetic sentences, tokenized with a word-level vocabulary built here, as a folder written by
`datasets.Dataset.save_to_disk`: columns input_ids (lists of varying length), attention_mask and label.

python make_data.py --out /tmp/prefect-elastic/hf-text [--samples 512] [--seed 0]

No download: the vocabulary is `VOCAB` below (model.py sizes the model's embedding from it). A sentence is
positive (label 1) when its opinion word is a positive one; the other words are filler.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

PAD, UNK = "[PAD]", "[UNK]"  # id 0 pads (model.py's pad_batch), id 1 stands for a word outside VOCAB
SUBJECTS = ["the movie", "this film", "the book", "that show", "the play", "my meal"]
LINKS = ["was", "is", "felt", "seemed", "looked"]
ADVERBS = ["", "very", "really", "quite", "so", "truly"]
POSITIVE = ["great", "good", "lovely", "wonderful", "fun"]
NEGATIVE = ["bad", "awful", "boring", "terrible", "dull"]
TAILS = ["", "today", "to me", "overall", "and long", "and short"]
WORDS = sorted(
    {w for part in (SUBJECTS, LINKS, ADVERBS, POSITIVE, NEGATIVE, TAILS) for p in part for w in p.split()}
)
VOCAB = {word: i for i, word in enumerate([PAD, UNK, *WORDS])}


def tokenize(sentence: str) -> list[int]:
    """Word-level ids of a sentence (lower case, split on spaces)."""
    return [VOCAB.get(word, VOCAB[UNK]) for word in sentence.lower().split()]


def sentences(samples: int, seed: int) -> tuple[list[str], list[int]]:
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(samples):
        label = rng.randrange(2)
        opinion = rng.choice(POSITIVE if label else NEGATIVE)
        words = [rng.choice(SUBJECTS), rng.choice(LINKS), rng.choice(ADVERBS), opinion, rng.choice(TAILS)]
        texts.append(" ".join(w for w in words if w))
        labels.append(label)
    return texts, labels


def write(out: Path, samples: int, seed: int) -> Path:
    import datasets

    texts, labels = sentences(samples, seed)
    ids = [tokenize(text) for text in texts]
    columns = {"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids], "label": labels}
    datasets.Dataset.from_dict(columns).save_to_disk(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (save_to_disk)")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(args.out, args.samples, args.seed)
    print(f"{args.samples} sentences, vocabulary of {len(VOCAB)}: {args.out.resolve()}")


if __name__ == "__main__":
    main()
