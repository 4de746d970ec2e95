"""A throwaway plugin distribution used by epochal's own tests."""
