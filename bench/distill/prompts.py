"""The committed training prompt set: templates × topics, drawn with a fixed seed.

`python -m bench.distill.prompts` rewrites train_prompts.txt; a test checks the file matches. No
template or topic of heldout_prompts.txt is used here, so the held-out score is honest.
"""

from __future__ import annotations

import random
from pathlib import Path

COUNT, SEED = 14400, 0
PATH = Path(__file__).parent / "train_prompts.txt"

TEMPLATES = [
    "Write a short story about {t}.", "Write a poem about {t}.", "Write a haiku about {t}.",
    "Write a limerick about {t}.", "Write a short email to a friend about {t}.",
    "Write a diary entry about {t}.", "Write a news headline and a short article about {t}.",
    "Write a product description for something related to {t}.", "Write a dialogue between two people about {t}.",
    "Write a motivational speech that mentions {t}.", "Write a tweet about {t}.",
    "Write a short essay on {t}.", "Write a song chorus about {t}.", "Write a riddle whose answer is {t}.",
    "Write a letter to the editor about {t}.", "Write an advertisement for a tour about {t}.",
    "Write a short mystery scene involving {t}.", "Write a recipe inspired by {t}.",
    "Write a formal report summary on {t}.", "Write a blog post introduction about {t}.",
    "Explain how {t} works, step by step.", "Explain {t} to a ten-year-old.", "Explain {t} in simple terms.",
    "Explain why people care about {t}.", "Explain the main ideas behind {t} in three sentences.",
    "Explain the history of {t} briefly.", "Summarize the history of {t} in a paragraph.",
    "Describe {t} in vivid detail.", "Describe a day in the life of someone who works with {t}.",
    "Describe what {t} looked like a hundred years ago.", "Describe {t} using only five adjectives, then explain each.",
    "What are the pros and cons of {t}?", "What would a day without {t} look like?",
    "What is the most important thing to know about {t}?",
    "What questions would a student ask about {t}?", "What is the future of {t}?",
    "What are three surprising facts about {t}?", "What can children learn from {t}?",
    "What would happen if {t} disappeared?", "What jobs are related to {t}?",
    "Why is {t} important?", "Why do some people dislike {t}?", "Why did {t} change over time?",
    "How has {t} changed the world?", "How would you teach someone about {t}?",
    "How do scientists study {t}?", "How can I learn more about {t}?", "How is {t} different in other countries?",
    "List five interesting facts about {t}.", "List the steps to get started with {t}.",
    "List three books or films that feature {t}.", "List ten words related to {t}.",
    "List the advantages of {t} as bullet points.",
    "Give me three tips related to {t}.", "Give me a short quiz about {t}.",
    "Give me an analogy that explains {t}.", "Give me a one-sentence summary of {t}.",
    "Give me a plan for a school project about {t}.",
    "Ask me three quiz questions about {t}, with answers.", "Compare {t} with something similar and explain the differences.",
    "Argue for and against {t}.", "Imagine you are {t}. Describe your day.",
    "Pretend you are a tour guide and introduce {t}.", "Create a lesson plan about {t}.",
    "Create a short FAQ about {t}.", "Invent a new holiday celebrating {t} and describe it.",
    "Suggest five names for a club about {t}.", "Suggest a weekend activity involving {t}.",
    "Tell a joke about {t}.", "Tell the story of {t} as a fairy tale.", "Outline a documentary about {t}.",
    "Plan a museum exhibit about {t}.", "Draft an interview with an expert on {t}.",
    "Share some advice for a beginner interested in {t}.", "Give a brief biography of {t} as if it were a person.",
    "In two paragraphs, discuss the impact of {t} on daily life.", "Can you help me understand {t}?",
    "I want to write an essay on {t}. Where should I start?", "My friend says {t} is boring. Convince them otherwise.",
    "Translate the idea of {t} into a metaphor and explain it.", "Rate {t} out of ten and justify the score.",
]

TOPICS = [
    "volcanoes", "honeybees", "the moon", "coffee", "the ocean", "dinosaurs", "the Roman Empire", "rainbows",
    "electric cars", "chess", "the internet", "photosynthesis", "black holes", "the printing press", "jazz music",
    "the human heart", "trains", "glaciers", "penguins", "the Great Wall of China", "recycling", "mountain climbing",
    "solar panels", "the piano", "octopuses", "wind turbines", "ancient Egypt", "comets", "friendship", "museums",
    "time zones", "elephants", "language learning", "wolves", "coral reefs", "machine learning", "bicycles",
    "rain forests", "the Olympic Games", "a pirate ship", "a haunted house", "a detective", "a small bakery",
    "gardening", "earthquakes", "public libraries", "chocolate", "the alphabet", "bread", "tea", "cheese",
    "the Eiffel Tower", "Mount Everest", "the Nile", "deserts", "lighthouses", "bridges", "skyscrapers",
    "airplanes", "hot air balloons", "rockets", "satellites", "the Milky Way", "Mars", "Jupiter", "the sun",
    "eclipses", "thunderstorms", "hurricanes", "snowflakes", "fog", "autumn leaves", "spring flowers",
    "sunflowers", "oak trees", "mushrooms", "cacti", "whales", "dolphins", "sharks", "sea turtles", "jellyfish",
    "crabs", "butterflies", "ants", "fireflies", "eagles", "parrots", "hummingbirds", "cats", "dogs", "horses",
    "rabbits", "foxes", "bears", "lions", "tigers", "giraffes", "zebras", "camels", "frogs", "snakes", "bats",
    "squirrels", "the immune system", "sleep", "dreams", "memory", "laughter", "music therapy", "yoga",
    "running", "swimming", "soccer", "basketball", "tennis", "marathons", "board games", "video games",
    "puzzles", "magic tricks", "circuses", "theater", "ballet", "opera", "painting", "sculpture", "photography",
    "origami", "knitting", "woodworking", "calligraphy", "poetry", "novels", "comic books", "newspapers",
    "podcasts", "television", "cinema", "smartphones", "computers", "robots", "3D printing", "batteries",
    "electricity", "magnets", "light bulbs", "telescopes", "microscopes", "vaccines", "antibiotics",
    "hospitals", "nurses", "firefighters", "farmers", "teachers", "astronomers", "architects", "chefs",
    "pilots", "sailors", "explorers", "inventors", "the Renaissance", "the Industrial Revolution",
    "the Silk Road", "the Vikings", "medieval castles", "knights", "samurai", "the Aztecs", "ancient Greece",
    "the pyramids", "Stonehenge", "democracy", "banks", "taxes", "markets", "small businesses",
    "advertising", "cities", "villages", "farms", "parks", "zoos", "aquariums", "schools", "universities",
    "homework", "exams", "kindness", "patience", "courage", "curiosity", "teamwork", "leadership", "habits",
    "time management", "budgeting", "cooking pasta", "baking cookies", "spices", "rice", "apples", "bananas",
    "strawberries", "honey", "ice cream", "soup", "sandwiches", "breakfast", "picnics", "camping", "hiking",
    "fishing", "sailing", "road trips", "trains at night", "maps", "compasses", "calendars",
    "birthdays", "weddings", "festivals", "fireworks", "snowmen", "beaches", "islands", "rivers", "lakes",
    "waterfalls", "caves", "canyons", "forests", "meadows", "climate change", "renewable energy", "plastic pollution", "clean water", "bees and pollination",
    "endangered species", "national parks", "space stations", "the speed of light", "gravity", "atoms",
    "DNA", "evolution", "fossils", "rocks and minerals", "diamonds", "gold", "iron", "glass", "cotton", "wool", "silk", "shoes", "hats", "bicycles in cities", "traffic lights", "elevators",
    "the postal service", "letters", "stamps", "coins", "keys", "locks", "mirrors", "candles", "lanterns",
]


def build(count: int = COUNT, seed: int = SEED) -> list[str]:
    pairs = [(a, b) for a in range(len(TEMPLATES)) for b in range(len(TOPICS))]
    random.Random(seed).shuffle(pairs)
    return [TEMPLATES[a].format(t=TOPICS[b]) for a, b in pairs[:count]]


if __name__ == "__main__":
    PATH.write_text("\n".join(build()) + "\n")
