"""Questions the real model's tests ask, chosen so that every weight variant answers them the same way."""

# q4 wins this one's first answer token by a wide margin (logit 34.1 vs 32.9). "What is the capital
# of France?" is a near tie at q4 (The 25.9, L 25.7): a last-bit change in a kernel's summation order
# flips it to "L'Étoile de la Cité…".
ROBUST_QUESTION = "How many days are in a week?"
ROBUST_ANSWER = "7"
