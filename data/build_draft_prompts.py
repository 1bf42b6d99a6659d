#!/usr/bin/env python
"""Writes data/draft_prompts_large.txt: the prompt set `upesi train-draft` uses by default.

The hand-written prompts of data/draft_prompts.txt, plus task templates crossed with topics (seeded, no duplicates),
so that the head sees many subjects and answer shapes. Prompts of bench/bench_speculative.py are never included:
that benchmark measures acceptance on text the head was not trained on.

    python data/build_draft_prompts.py [--count 3000] [--seed 0]
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

TOPICS = """the Roman Empire|photosynthesis|black holes|the water cycle|volcanoes|earthquakes|the human heart|
the immune system|DNA|vaccines|climate change|renewable energy|solar panels|wind turbines|electric cars|batteries|
the internet|email|smartphones|social media|artificial intelligence|neural networks|machine learning|databases|
cloud computing|cybersecurity|passwords|encryption|blockchain|open source software|the Python language|
recursion|sorting algorithms|binary numbers|prime numbers|fractions|probability|statistics|geometry|algebra|
calculus|the Pythagorean theorem|gravity|magnets|electricity|light|sound|rainbows|the Moon|Mars|the Sun|
comets|the solar system|the Milky Way|telescopes|rockets|the International Space Station|airplanes|trains|
bicycles|bridges|skyscrapers|the printing press|the telephone|the steam engine|the Industrial Revolution|
the Renaissance|ancient Egypt|ancient Greece|the Silk Road|the Vikings|the Great Wall of China|the French Revolution|
the Cold War|the Olympic Games|democracy|taxes|inflation|interest rates|budgeting|saving money|investing|
small businesses|marketing|job interviews|resumes|public speaking|leadership|teamwork|time management|
procrastination|habits|sleep|exercise|running|yoga|meditation|stress|nutrition|vitamins|drinking water|
coffee|tea|chocolate|bread|pizza|pasta|rice|vegetarian cooking|baking|gardening|houseplants|composting|
recycling|plastic pollution|oceans|coral reefs|rainforests|deserts|the Amazon river|mountains|glaciers|
weather|hurricanes|snow|seasons|bees|ants|butterflies|birds|owls|dolphins|whales|sharks|octopuses|elephants|
lions|wolves|dogs|cats|horses|dinosaurs|evolution|fossils|cells|bacteria|viruses|the brain|memory|dreams|
emotions|friendship|kindness|honesty|gratitude|music|jazz|classical music|the guitar|the piano|painting|
photography|movies|theater|poetry|novels|libraries|museums|chess|soccer|basketball|tennis|swimming|
video games|board games|puzzles|camping|hiking|travel|maps|languages|learning Spanish|writing essays|
grammar|reading|math homework|online classes|teachers|kindergarten|universities|scholarships|volunteering|
cities|villages|farming|tractors|coffee shops|restaurants|supermarkets|money|credit cards|shopping online|
robots|drones|3D printing|virtual reality|self-driving cars|satellites|GPS|clocks|calendars|holidays|birthdays|
weddings|family|grandparents|parenting|babies|teenagers|retirement|moving house|apartments|furniture|
cleaning|laundry|cooking for one|picnics|the beach|islands|lighthouses|pirates|castles|knights|dragons|
wizards|detectives|spies|superheroes|time travel|the future|the year 2100|space colonies|aliens""".replace("\n", "")

TEMPLATES = """Explain {t} in simple terms.|What is {t}?|Tell me about {t}.|Give three interesting facts about {t}.|
Write a short poem about {t}.|Write a short story that involves {t}.|Summarize the history of {t} in a paragraph.|
What are common misconceptions about {t}?|Why is {t} important?|Explain {t} to a ten-year-old.|
Write a tweet about {t}.|What are the pros and cons of {t}?|Compare {t} with something from everyday life.|
List five questions a student might ask about {t}.|Write a haiku about {t}.|How would you teach a class about {t}?|
Describe {t} in three sentences.|What should a beginner know about {t}?|
Write a short dialogue between two friends about {t}.|
Give me a fun quiz with three questions about {t}.|Write an encouraging note to someone who is learning about {t}.|
What is the most surprising thing about {t}?|Write a limerick about {t}.|
How has {t} changed over the last hundred years?|
Write a short news headline and summary about {t}.|Give me an analogy that explains {t}.|
What are three words that describe {t}, and why?|Write the opening paragraph of an essay about {t}.|
Describe a day in the life of someone who works with {t}.|What would the world be like without {t}?""".replace("\n", "")

TASKS = """Write a polite email declining an invitation.|Give me a recipe for a simple soup.|
How do I make a cup of tea?|Translate 'good morning, how are you?' into French and Spanish.|
What is 12 times 15? Show your steps.|What is 144 divided by 12?|Solve 3x + 5 = 20.|
Write a Python function that reverses a string.|Write a Python function that checks whether a number is prime.|
Write a Python function that returns the largest number in a list.|Explain what a for loop does.|
What is the difference between a list and a tuple in Python?|Write a SQL query that counts the rows of a table.|
Give me a packing list for a weekend trip.|Plan a three-day trip to Rome.|Suggest five names for a bakery.|
Write a thank-you note to a teacher.|How can I improve my handwriting?|What should I say in a job interview?|
Give me tips for a first day at a new job.|Write a birthday message for my sister.|
How do I apologize to a friend?|Suggest a weekly workout plan for a beginner.|What are good habits for studying?|
Give me a list of ten healthy snacks.|How can I fall asleep faster?|How do I change a flat tire?|
Explain how a refrigerator works.|How does a compass work?|How do airplanes stay in the air?|
Why is the ocean salty?|Why do leaves change color in autumn?|How are rainbows formed?|
What is the difference between weather and climate?|What is the difference between a virus and a bacterium?|
Write a product description for a backpack.|Write a short advertisement for a bicycle shop.|
Summarize the plot of Romeo and Juliet.|Who was Albert Einstein?|Who was Marie Curie?|Who was Leonardo da Vinci?|
What is a good way to start a story?|Give me a writing prompt for a mystery story.|Tell me a joke about computers.|
Write a riddle and give its answer.|Convert 5 kilometers to miles.|How many seconds are in a day?|
What is the capital of Japan?|Name the planets of the solar system in order.|How do I make a budget?|
What is a healthy breakfast?|Describe the taste of a lemon to someone who has never had one.""".replace("\n", "")

BENCH = {  # bench/bench_speculative.py's prompts: kept out of the training set
    "Write a short story about a robot learning to paint.", "Explain how a hash table works.",
    "List five tips for staying healthy.", "What is photosynthesis?", "Give me a recipe for pancakes.",
    "Why is the sky blue?", "Write a polite email asking a colleague for a meeting next week.",
    "What are the benefits of drinking water?"}


def build(count: int, seed: int) -> list[str]:
    topics = [t.strip() for t in TOPICS.split("|") if t.strip()]
    templates = [t.strip() for t in TEMPLATES.split("|") if t.strip()]
    rng = random.Random(seed)
    out = [line.strip() for line in (HERE / "draft_prompts.txt").read_text().splitlines() if line.strip()]
    out += [t.strip() for t in TASKS.split("|") if t.strip()]
    combos = [tpl.format(t=topic) for tpl in templates for topic in topics]
    rng.shuffle(combos)
    seen = set()
    unique = []
    for p in out + combos:
        if p not in seen and p not in BENCH:
            seen.add(p)
            unique.append(p)
    return unique[:count]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "draft_prompts_large.txt"))
    args = ap.parse_args()
    prompts = build(args.count, args.seed)
    Path(args.out).write_text("\n".join(prompts) + "\n")
    print(f"{len(prompts)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
