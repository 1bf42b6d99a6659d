"""The benchmarks' prompt sets.

    chat      four short questions (what bench_peers.py and bench_generate.py have always used)
    grounded  four edits of a given text of ~300 tokens (rewrite, correct, reformat), so that the answer copies
              long runs of the prompt: the load prompt lookup and draft heads are measured on beside chat
    mixed     the two interleaved (chat, grounded, chat, ...): one deployment serving both kinds, whose choice to
              speculate or not is learned from the mix
"""
from __future__ import annotations

CHAT = [
    "Write a short story about a robot learning to paint.",
    "Explain how a hash table works.",
    "List five tips for staying healthy.",
    "What is photosynthesis?",
]

_HARBOUR = (
    "The harbour town of Kelmouth grew up around a narrow inlet on the western coast, where the cliffs break and a "
    "shingle beach slopes gently into deep water. For centuries its people lived from fishing, and the boats that "
    "left before dawn came back in the afternoon with herring, mackerel and, in good years, cod from the banks "
    "twenty miles out. In the eighteenth century a stone pier was built to shelter the boats from the winter storms, "
    "and a small customs house was added beside it, because the inlet had become a convenient place to land wine, "
    "tea and tobacco without paying duty. The railway arrived in 1872 and changed the town again: fish could now "
    "reach the markets of the capital overnight, and visitors came the other way, filling the new boarding houses "
    "along the seafront every summer. By 1900 the population had doubled. The fishing fleet declined after the "
    "Second World War, when larger trawlers from other ports took over the distant grounds, but tourism kept the "
    "town alive. Today the old customs house is a museum, the pier is used by pleasure boats and a few crab "
    "fishermen, and the boarding houses have become hotels, cafes and holiday flats."
)

_GARDEN = (
    "Growing tomatoes in a small garden are easier then most people thinks. The plants needs at least six hours "
    "of direct sun each day, so choose the brightest spot you has, ideally against a south facing wall that keep "
    "the warmth in the evening. Start the seeds indoor about eight weeks before the last frost, in small pots of "
    "fine compost, and keep them on a warm windowsill untill they are about twenty centimetres tall. When the "
    "nights is reliably warm, plant them out into rich soil that has been dug over with plenty of well rotted "
    "manure, setting each plant a little deeper then it grew in the pot. Tall varieties needs a strong cane or a "
    "string to climb, and the small side shoots that grows between the main stem and the leaves should be pinched "
    "out every week so that the plant put its energy into fruit. Water deeply and regular, because uneven watering "
    "cause the fruit to split, and feed the plants once a week with a high potash feed as soon as the first "
    "flowers appears. Pick the tomatoes when they are fully coloured and slightly soft, and they will tastes far "
    "better than any you can buy in a shop."
)

GROUNDED = [
    f"Rewrite the following text in simpler English, keeping every fact and the order of the sentences:\n\n{_HARBOUR}",
    f"Correct the grammar and spelling mistakes in the following text. Return the corrected text only:\n\n{_GARDEN}",
    f"Rewrite the following text in the present tense, changing nothing else:\n\n{_HARBOUR}",
    f"Copy the following text, putting each sentence on its own line as a bulleted list:\n\n{_GARDEN}",
]

WORKLOADS = {"chat": CHAT, "grounded": GROUNDED, "mixed": [p for pair in zip(CHAT, GROUNDED) for p in pair]}
