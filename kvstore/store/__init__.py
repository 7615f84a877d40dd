"""The store: one planner that decides (planner.py), one executor that moves
bytes between tiers as the planner says (moves.py), the async tiered store
over both (tiered.py), its synchronous facade (sync.py), the Protocol every
facade meets (facade.py) and the factory that builds one from a config
(factory.py)."""
