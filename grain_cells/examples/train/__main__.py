"""`python -m grain_cells.examples.train`: runs `main.main` under absl."""

# Grain's spawned workers run this module again (as __mp_main__); they must
# not import JAX or define flags for nothing, hence the imports in the guard.
if __name__ == "__main__":
    from absl import app

    from grain_cells.examples.train import main

    app.run(main.main)
