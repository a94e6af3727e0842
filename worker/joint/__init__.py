"""The joint path: a locked draft proposes, the target verifies and stays in control."""
