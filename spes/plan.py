"""`python -m spes.plan`: the memory planner (spes/train/plan.py) under its short name."""
from spes.train.plan import main

if __name__ == "__main__":
    main()
