package relay

// Every test of the package checks, at every push that takes the
// shortcut, that a stream's known tree skipped as the view would have
// been built as the view (stream.emit).
func init() { checkWhole = true }
