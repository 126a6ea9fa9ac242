"""The engine: configuration, the step (schedule -> propose -> forward -> verify -> commit), its
outputs, the background loop that drives it, elastic memory and the adaptive controller."""
