"""Tools that measure and prove the product rather than being it: the soak (load and faults
together, with the invariants checked afterwards) and its stand-ins."""
