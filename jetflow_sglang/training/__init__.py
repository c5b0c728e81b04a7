"""Training room: prompt sets and data (`data`), target-written responses (`regenerate`),
the frozen target's cached features and soft labels (`features`), the head's trainer
(`train`), evaluation (`evaluate`) and the end-to-end recipe behind the shipped heads
(`recipe`)."""
