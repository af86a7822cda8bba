"""Scoring for pagoda_capitals.yaml."""


def names_the_answer(doc, results):
    """1 when the generated text names the capital (case-insensitive)."""
    text = results[0].lower()
    return {"names_answer": float(doc["answer"].lower() in text)}
