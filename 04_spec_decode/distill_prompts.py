"""The instructions the target answers to write an EAGLE head's training text (self-distillation).

EAGLE and Medusa-2 train the draft head on text the TARGET wrote: the head then learns the
target's own feature dynamics on the target's own distribution. Such text needs many varied
instructions; downloading a chat dataset is not possible here, so they are built from text that
ships with every Python: the standard library's docstrings (read with `ast`, nothing imported)
and the names of its modules and functions, put into a few dozen instruction templates —
summarise / explain / rewrite a paragraph, questions about a function, and open-ended requests
(poems, stories, facts, advice) about topic words drawn from the same text or from a list of
everyday subjects written here — most of what a chat model is asked is everyday, and a head
trained on docstrings alone drafts chat poorly (held-out top-1 0.25 where its own training
text gave 0.39).

    instructions(n, seed)          -> n distinct instructions, a fixed function of (n, seed)
    HELD_OUT                       -> instructions no training set contains (acceptance is measured on these)

Everything is deterministic given the seed and the Python version (its docstrings are the corpus).
"""
from __future__ import annotations

import ast
import random
import re
import sysconfig
from functools import lru_cache
from pathlib import Path

# Open chat the training never sees: the acceptance the head reports is measured on these.
HELD_OUT = [
    "What is the capital of France, and what is it famous for?", "Explain how a rainbow forms.",
    "Write a limerick about a cat who loves cheese.", "Give me three tips for studying effectively.",
    "Describe the water cycle for a ten-year-old.", "What are the benefits of regular exercise?",
    "Write a short thank-you note to a teacher.", "How do I make a cup of green tea?",
    "Why do leaves change colour in autumn?", "Write a short story about a dragon who is afraid of the dark.",
    "What should I pack for a weekend camping trip?", "Explain the difference between weather and climate.",
    "Give me a simple recipe for pancakes.", "How does a bicycle stay upright?",
    "Write a motivational message for someone starting a new job.", "What are volcanoes and why do they erupt?",
]

PARAGRAPH_TASKS = [
    "Summarize the following text in one or two sentences:\n\n{text}",
    "Explain the following to a beginner, in plain words:\n\n{text}",
    "Rewrite this paragraph so that it is easier to read:\n\n{text}",
    "What is the main idea of this text?\n\n{text}",
    "Write three questions a student might ask about this text:\n\n{text}",
    "Turn this text into a short bulleted list of key points:\n\n{text}",
    "Repeat this text exactly, word for word:\n\n{text}",
    "Translate this technical description into an everyday analogy:\n\n{text}",
]
FUNCTION_TASKS = [
    "What does the Python function `{name}` from the `{module}` module do?",
    "Write a short example program that uses `{module}.{name}`.",
    "Its documentation says: \"{doc}\" Explain what `{module}.{name}` is for.",
    "When would a programmer use `{module}.{name}`? Give an example.",
]
TOPIC_TASKS = [
    "Write a short poem about {topic}.", "Tell a very short story that involves {topic}.",
    "Give three interesting facts about {topic}.", "Explain {topic} to a ten-year-old.",
    "What are the advantages and disadvantages of {topic}?", "Write a short email to a friend about {topic}.",
    "Describe {topic} in three sentences.", "Write a haiku about {topic}.",
    "List five words that remind you of {topic}.", "Write a product review of something related to {topic}.",
    "How would you teach someone about {topic}?", "Write a dialogue between two people discussing {topic}.",
    "What is the history of {topic}, briefly?", "Give some advice about {topic}.",
    "What is {topic}?", "How does {topic} work?", "Why do people like {topic}?",
    "Give me three tips about {topic}.", "Write a short story about {topic}.", "Write a limerick about {topic}.",
    "Write a short speech about {topic}.", "What are some fun facts about {topic}?",
    "Explain {topic} in simple terms.", "Write a motivational message about {topic}.",
]
EVERYDAY_TOPICS = [
    "rain", "the ocean", "a city at night", "coffee", "mountains", "a lost key", "friendship", "trains",
    "the moon", "a library", "bicycles", "gardening", "winter mornings", "an old lighthouse", "music",
    "honey bees", "the desert", "a bakery", "snow", "robots", "rivers", "a market", "clocks", "cooking",
    "sleep", "birthdays", "museums", "football", "chess", "the internet", "photography", "forests",
    # Everyday chat: what people ask a chat model about (none of HELD_OUT's subjects)
    "saving money", "public speaking", "time management", "healthy breakfasts",
    "houseplants", "dogs", "owls", "dolphins", "elephants", "penguins", "butterflies", "earthquakes",
    "thunderstorms", "tides", "the solar system", "black holes", "the human heart", "vitamins", "dinosaurs",
    "ancient Egypt", "the Roman Empire", "the printing press", "electricity", "magnets", "recycling",
    "electric cars", "airplanes", "submarines", "bridges", "skyscrapers", "soap", "bread", "origami",
    "kites", "a science fair",
    "chocolate", "pizza", "soup", "a picnic", "a road trip", "packing for a flight", "a job interview",
    "writing a resume", "a first day at school", "moving to a new city", "a rainy weekend", "board games",
    "video games", "painting", "knitting", "the guitar", "the piano", "dancing", "running a marathon",
    "swimming", "yoga", "meditation", "a good night's sleep", "stress", "kindness", "patience", "curiosity",
    "a birthday party", "a wedding", "grandparents", "a new puppy", "a best friend", "neighbours",
    "a small business", "a lemonade stand", "volunteering", "the post office", "a hospital", "firefighters",
    "farmers", "a train station", "an airport", "a pirate ship", "a treasure map",
    "a haunted house", "a time machine", "a talking tree", "a robot chef", "a space station", "Mars",
    "the Arctic", "a rainforest", "a coral reef", "a waterfall", "a quiet village", "a busy kitchen",
    "spring flowers", "summer holidays", "the first snowfall", "a sunrise", "stars at night", "fireworks",
    "a thunderstorm at sea", "a bus ride", "a lost umbrella", "a broken phone", "online shopping",
    "social media", "email etiquette", "passwords", "smartphones", "3D printing", "solar panels", "wind energy",
]
_STOP = set("""about above after again against their there these those which while where would could should
other being before below between both during each further having into more most once only over same some
such than that then them they this through under until very what when will with your from have does done
return returns returned value values object objects argument arguments default function functions method
methods class classes module modules string strings instance instances given called calling following
using used number numbers specified optional otherwise itself because""".split())


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@lru_cache(maxsize=1)
def stdlib_texts() -> tuple[list[str], list[tuple[str, str, str]]]:
    """(paragraphs of docstrings, (module, function, first doc line) triples) from the stdlib's
    own source: files read and parsed, never imported; tests, idlelib and private names skipped."""
    paragraphs, functions = [], []
    root = stdlib_dir()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in ("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo") or
               part.startswith("_") for part in rel.parts[:-1]) or rel.name.startswith("_"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts)
        for node in [tree, *ast.walk(tree)]:
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            for para in re.split(r"\n\s*\n", doc):
                text = " ".join(para.split())
                # prose, not doctest examples, tables or signatures
                if 120 <= len(text) <= 700 and ">>>" not in text and text.count(" ") > 15 and text[0].isupper():
                    paragraphs.append(text)
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                first = " ".join(doc.split("\n\n")[0].split())
                if 20 <= len(first) <= 200:
                    functions.append((module, node.name, first))
    return paragraphs, functions


def topic_words(paragraphs: list[str]) -> list[str]:
    """Topics for the open requests: the corpus's nouns, roughly — words of 5-12 letters that
    follow "a", "an" or "the" at least 3 times (not function words) — and a few everyday ones
    (answers about daily life read differently from answers about sockets)."""
    counts: dict[str, int] = {}
    for p in paragraphs:
        for w in re.findall(r"\b(?:a|an|the)\s+([a-z]{5,12})\b", p):
            if w not in _STOP:
                counts[w] = counts.get(w, 0) + 1
    ranked = sorted((w for w, c in counts.items() if c >= 3), key=lambda w: (-counts[w], w))
    return EVERYDAY_TOPICS + [f"the {w}" if rank % 2 else w for rank, w in enumerate(ranked)]


def instructions(n: int, seed: int = 0) -> list[str]:
    """n distinct instructions: 1/4 about a docstring paragraph, 1/8 about a function, 5/8 open
    requests about a topic — half of those an everyday one (EVERYDAY_TOPICS: chat is what the head
    drafts for), half a word of the docstrings — in an order fixed by `seed`. None is in HELD_OUT."""
    paragraphs, functions = stdlib_texts()
    words = topic_words(paragraphs)
    rng = random.Random(seed)
    held, seen, out = set(HELD_OUT), set(), []
    kinds = ["paragraph"] * 2 + ["function"] + ["topic"] * 5
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"cannot build {n} distinct instructions from this Python's docstrings "
                             f"({len(paragraphs)} paragraphs, {len(functions)} functions)")
        kind = kinds[rng.randrange(len(kinds))]
        if kind == "paragraph":
            text = rng.choice(PARAGRAPH_TASKS).format(text=rng.choice(paragraphs))
        elif kind == "function":
            module, name, doc = rng.choice(functions)
            text = rng.choice(FUNCTION_TASKS).format(module=module, name=name, doc=doc)
        else:
            topic = rng.choice(EVERYDAY_TOPICS if rng.random() < 0.5 else words)
            text = rng.choice(TOPIC_TASKS).format(topic=topic)
        if text not in seen and text not in held:
            seen.add(text)
            out.append(text)
    return out
