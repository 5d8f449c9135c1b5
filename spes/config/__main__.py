"""python -m spes.config PARAMS [--set-params]: validate a params file, or print the `dvc exp run` flags that
turn params.yaml into it."""
from spes.config.loader import main

if __name__ == "__main__":
    main()
