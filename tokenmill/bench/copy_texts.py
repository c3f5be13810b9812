"""The ``copy`` dataset of ``tokenmill bench``: chat requests whose answers repeat much of their prompt (edit,
proofread, quote), the shape where prompt-lookup speculation pays. Plain text written for this benchmark."""

PASSAGES = [
    "The old lighthouse stood on a rock at the mouth of the harbour. Every night its keeper climbed the ninety-two "
    "steps, trimmed the wick and wound the clockwork that turned the great lens. Ships far out at sea saw the beam "
    "sweep across the water once every twelve seconds and knew where the rocks lay.",
    "To make bread, mix five hundred grams of flour with ten grams of salt and seven grams of dried yeast. Add three "
    "hundred and fifty millilitres of warm water and knead the dough for ten minutes until it is smooth. Leave it "
    "to rise for an hour, shape it into a loaf, let it rise again and bake it for thirty-five minutes.",
    "The committee met on Tuesday to review the budget for the coming year. It agreed to keep the library open on "
    "Saturdays, to repair the roof of the community hall before winter and to buy two new computers for the school. "
    "The proposal to widen the car park was postponed until the spring meeting.",
    "A binary search finds a value in a sorted list by comparing it with the middle element. If the value is "
    "smaller, the search continues in the left half; if it is larger, in the right half. Each comparison halves the "
    "remaining range, so a list of one million elements needs at most twenty comparisons.",
    "The expedition left the base camp at dawn and followed the glacier north for six hours. In the afternoon the "
    "weather turned, and the team pitched their tents in the shelter of a ridge. They waited two days for the storm "
    "to pass before they could continue towards the summit.",
    "Our support team is available from nine in the morning until six in the evening, Monday to Friday. To reset "
    "your password, open the settings page, choose security, and follow the link sent to your email address. If the "
    "link has expired, request a new one; each link is valid for twenty-four hours.",
    "The garden was planted in long rows: tomatoes along the south wall, beans climbing the fence, and lettuce in the "
    "shade of the apple tree. Every morning the children carried water from the well, and by midsummer the baskets "
    "were full of vegetables for the whole village.",
    "The function reads the configuration file, checks that every required field is present and returns a "
    "dictionary of settings. When a field is missing it raises an error that names the field and the file. Optional "
    "fields take their default values, which are listed at the top of the module.",
]

INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Proofread the following text and return it in full, with any mistakes corrected:\n\n{}",
    "Quote the following text in full, then add one sentence that summarizes it:\n\n{}",
]


def copy_prompts(count: int) -> list[str]:
    """``count`` prompts cycling over every (instruction, passage) pair."""
    pairs = [(i, p) for i in INSTRUCTIONS for p in PASSAGES]
    return [pairs[n % len(pairs)][0].format(pairs[n % len(pairs)][1]) for n in range(count)]
