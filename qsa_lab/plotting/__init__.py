"""Drawing: every function takes its data and an optional axis and returns the axis; figure export;
the playground's render and repaint."""
