//go:build !linux

package realistio

import "syscall"

// childAttr: elsewhere the tests' cleanups alone stop what they start.
func childAttr() *syscall.SysProcAttr { return nil }
