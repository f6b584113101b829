// Package inspectpb holds what one relay tells the others about the keys
// and nodes it holds (inspect.proto, meshrelay.inspect.v1), for the tier's
// admin API, and the code generated for it; package relay serves it.
//
// The generated files are committed: a build needs no protoc. Regenerate
// them, after installing protoc 3.21.12 (Debian's protobuf-compiler) and
// the two pinned plugins, with:
//
//	go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
//	go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
//	go generate ./relay/inspectpb
package inspectpb

//go:generate protoc -I ../.. --go_out=../.. --go_opt=paths=source_relative --go-grpc_out=../.. --go-grpc_opt=paths=source_relative relay/inspectpb/inspect.proto
