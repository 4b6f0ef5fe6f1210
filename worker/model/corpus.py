"""A small embedded English corpus to train the tiny models' byte-level BPE tokenizer offline.

Original text written for this project (no licence strings attached). Its only job is to give
the BPE trainer enough frequent words and sub-words that a few hundred merges are useful.
"""

CORPUS = """\
A serving cluster answers many requests at once. Each request carries a prompt, and the model
reads the prompt before it writes a single new word. Reading the prompt is called prefill;
writing the answer one token at a time is called decode. Prefill is heavy on arithmetic, decode
is heavy on memory, and a good scheduler mixes the two so that neither the arithmetic units nor
the memory bus sit idle for long.

The keys and values that attention computes for every token are kept in a cache. Without the
cache, every new token would have to look again at every old token from scratch. With the cache,
the model only computes the keys and values of the new token and reads the rest from memory.
The cache grows with the length of the conversation, and on a busy server it is the largest
user of memory after the weights themselves.

Paged attention stores the cache in fixed-size blocks, much like an operating system stores the
memory of a process in pages. A sequence owns a list of block numbers, its block table. The
blocks of one sequence need not be next to each other; they can be anywhere in the pool. When a
sequence ends, its blocks go back to the free list, and another sequence can use them at once.
Nothing has to be moved, and no memory is lost to gaps between sequences.

Two requests that begin with the same words can share the blocks of that common beginning. A
system prompt that is sent with every request is the most common case: it is computed once and
then read by every request that starts with it. To find a shared beginning quickly, each full
block is named by a hash of its tokens and of the hash of the block before it. Two equal hashes
at the same place mean two equal prefixes, and the second request skips the work.

When a shared block must change, the sequence that wants to write copies it first. This is
copy on write: readers keep the old block, the writer gets a fresh copy, and no one sees a
half-written block. The copy is cheap because only one block moves, not the whole sequence.

The router in front of the workers decides where each request goes. If it sends a request to
the worker that already holds the longest part of its prompt, the prompt is read faster. But if
it sends every request to the same worker, that worker is overloaded while the others wait. A
good router weighs the saved work against the queue it would join, and it keeps working when
the index of cached blocks is slow or missing.

Once upon a time there was a small village by a river. In the morning the baker opened his shop
and the smell of fresh bread filled the street. Children ran to school, the old fisherman mended
his nets, and the teacher wrote the lesson of the day on the board. In the afternoon the sky
turned grey, the wind rose, and rain fell on the roofs until the evening. When the rain stopped,
the people of the village came out to look at the river, which was higher than anyone could
remember. They worked together through the night to build a wall of sand bags, and in the
morning the water began to fall again.

The weather today is cold and windy in the north, mild in the south, and dry in the west. Tomorrow
the clouds will clear, the sun will shine for most of the day, and the temperature will rise by a
few degrees. Over the weekend a new front will bring rain to the coast and snow to the mountains.

To make a simple soup, cut two onions, three carrots and a few potatoes into small pieces. Warm
some oil in a large pot, add the onions and cook them until they are soft. Add the carrots and the
potatoes, pour in enough water to cover them, add salt and pepper, and let everything simmer for
half an hour. Serve the soup hot with a slice of bread.

Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are there in a week? Answer: There are seven days in a week.
Question: What do plants need to grow? Answer: Plants need light, water, air and good soil.
Question: Why is the sky blue? Answer: Air scatters blue light more than red light.
Question: What is two plus two? Answer: Two plus two is four.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count

The numbers one, two, three, four, five, six, seven, eight, nine and ten are written as 1, 2, 3,
4, 5, 6, 7, 8, 9 and 10. The year has twelve months: January, February, March, April, May, June,
July, August, September, October, November and December. The days of the week are Monday,
Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.

User: Hello! Can you help me plan a trip? Assistant: Of course. Where would you like to go, and
for how many days? User: I would like to visit the mountains for three days. Assistant: A good
plan is to arrive on the first day and rest, walk to the lake on the second day, and climb to the
view point on the third day before you travel home. Remember to bring warm clothes, water and a
map, and tell someone where you are going.

Science begins with a question and a careful look at the world. A scientist makes a guess, tests
it with an experiment, and changes the guess when the results do not agree. Over many years these
small steps build a picture of how things work, from the smallest particles to the largest stars.
The picture is never finished: every answer opens new questions, and that is what keeps the work
interesting.
"""
