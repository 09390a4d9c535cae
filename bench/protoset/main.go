// Command protoset writes the descriptor set of Envoy's rate limit service (rls.proto and every
// file it imports, from go-control-plane's compiled descriptors) to stdout, for a gRPC load tool
// that reads one (ghz --protoset): Sluice's RLS server, like envoyproxy/ratelimit's, offers no
// reflection.
//
//	go run ./bench/protoset > rls.protoset
package main

import (
	"log"
	"os"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
)

func main() {
	set := &descriptorpb.FileDescriptorSet{}
	seen := map[string]bool{}
	// Imports first: a descriptor set lists each file after the files it imports.
	var add func(f protoreflect.FileDescriptor)
	add = func(f protoreflect.FileDescriptor) {
		if seen[f.Path()] {
			return
		}
		seen[f.Path()] = true
		imports := f.Imports()
		for i := range imports.Len() {
			add(imports.Get(i).FileDescriptor)
		}
		set.File = append(set.File, protodesc.ToFileDescriptorProto(f))
	}
	add(rlsv3.File_envoy_service_ratelimit_v3_rls_proto)
	out, err := proto.Marshal(set)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := os.Stdout.Write(out); err != nil {
		log.Fatal(err)
	}
}
