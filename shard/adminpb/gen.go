// Package adminpb holds the tier's admin API (admin.proto,
// meshrelay.admin.v1) and the code generated for it; package shard serves
// it.
//
// The generated files are committed: a build needs no protoc. Regenerate
// them, after installing protoc 3.21.12 (Debian's protobuf-compiler) and
// the two pinned plugins, with:
//
//	go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
//	go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
//	go generate ./shard/adminpb
package adminpb

//go:generate protoc -I ../.. --go_out=../.. --go_opt=paths=source_relative --go-grpc_out=../.. --go-grpc_opt=paths=source_relative shard/adminpb/admin.proto
