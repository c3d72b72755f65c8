"""Open questions for the ``chat`` workload (``instruct.py``): what an instruct model's
users ask when there is nothing in the prompt to copy.

Python rather than ``.txt`` so it installs without a ``package-data`` entry.
"""

QUESTIONS: tuple[str, ...] = (
    # general knowledge
    "Why is the sky blue?",
    "How do vaccines train the immune system?",
    "What causes the seasons on Earth?",
    "Explain the difference between weather and climate.",
    "How does a refrigerator keep food cold?",
    "What was the Silk Road and why did it matter?",
    "Why do cats purr?",
    "How do airplanes stay in the air?",
    "What is the difference between a virus and a bacterium?",
    "How are rainbows formed?",
    # advice
    "I have a job interview tomorrow. How should I prepare tonight?",
    "How can I get better at waking up early?",
    "What are some good ways to save money on groceries?",
    "My friend and I had an argument. How do I start a conversation to make up?",
    "How do I stay focused when working from home?",
    "I want to start running. What should a beginner keep in mind?",
    "What should I consider before adopting a dog?",
    "How can I make my small apartment feel less cluttered?",
    # how-to
    "How do I make a simple tomato pasta sauce?",
    "Give me step-by-step instructions to change a flat bicycle tire.",
    "How do I write a polite email asking my manager for a day off?",
    "How do I plant and care for tomatoes on a balcony?",
    "What is a good way to learn the basics of a new language in three months?",
    "How do I clean a cast iron pan?",
    "How do I prepare a short presentation for my class?",
    # short stories and creative writing
    "Write a short story about a robot who learns to paint.",
    "Tell me a short bedtime story about a sleepy dragon.",
    "Write a short poem about the ocean at night.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe a busy market in a small town on a Saturday morning.",
    "Write a haiku about autumn leaves.",
    "Write a short dialogue between a cat and a mouse who become friends.",
    # everyday programming (answered, not copied: no code in the prompt)
    "What is the difference between a list and a tuple in Python?",
    "What is recursion? Give a simple example.",
    "How does a hash table work?",
    "What does an API do, in simple terms?",
    "What is the difference between RAM and storage?",
    # opinion and comparison
    "What are the pros and cons of electric cars?",
    "Is it better to read books on paper or on a screen?",
    "Compare living in a big city with living in the countryside.",
    "What makes a good teacher?",
    "Suggest three fun activities for a rainy weekend.",
)
